//! What the nodes' replies to one operation mean, given how many must agree. Pure
//! functions of the replies: the contest loop, the release path and the watchdog act on
//! the verdicts and never count nodes themselves.

use std::time::Duration;

use crate::clock::Stamp;

use crate::error::{Error, LostReason, Result, Unlocked};
use crate::proto::node::{NodeId, ReleaseReply, may_have_run};
use crate::proto::protocol::Attempt;

/// What one round of acquire attempts, one per node of the route, decided.
#[derive(Debug)]
pub(crate) enum Vote {
    /// The lock is ours: the highest fence among the granting nodes, those nodes, and the
    /// ones among them whose counter is behind that fence (to be raised). `previous_lost`:
    /// a granting node's counter said the hold before ended without a release (Redlock:
    /// any of them, since a lost hold's majority and this one share at least one node).
    Won {
        fence: u64,
        granted: Vec<NodeId>,
        behind: Vec<NodeId>,
        others_wait: bool,
        previous_lost: bool,
        /// A node's attempt may still land after the hold's release and take the lock again
        /// (see `Attempt::Held`): a granting node's reply was a retry's after a lost one,
        /// or another node's reply was lost (Redlock). The release is looked at again.
        resent: bool,
        /// The other nodes that may hold our token (a lost reply, a grant without enough
        /// replicas): to be undone with `granted` when the win is given up after all (its
        /// fence raised on too few nodes, or its lease spent by the raises). A win handed
        /// out needs none: its release goes to every node, and is looked at again.
        stray: Undo,
    },
    /// Held elsewhere: wait until the first of an event and `hint` (the holder's
    /// remaining lease, or a jitter after a split vote), after releasing our token on
    /// `undo`.
    Held { hint: Option<Duration>, undo: Undo },
    /// The round failed: return `error`, after releasing our token on `undo`.
    Failed { error: Error, undo: Undo },
    /// Enough nodes granted, but the lease had no time left by the time they said so (a
    /// server or network stalled longer than the lease): no guard may be born dead, so
    /// give our token back on `undo` and try again at once.
    Late { undo: Undo },
}

/// Where a round that is not ours left, or may have left, our token.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Undo {
    /// Nodes that granted: worth a release the caller waits for, while its deadline allows.
    pub granted: Vec<NodeId>,
    /// Nodes whose reply was lost, or answered a retry after a lost one: the attempt may
    /// have run, or may land later. Given back without waiting (a node that just failed
    /// may fail again, and the caller's deadline is not spent on it), and looked at again;
    /// a node may be among `granted` too (a retry granted there).
    pub unknown: Vec<NodeId>,
}

impl Undo {
    pub fn is_empty(&self) -> bool {
        self.granted.is_empty() && self.unknown.is_empty()
    }

    /// Adds what an earlier attempt with the same token may have left.
    pub fn absorb(&mut self, earlier: Undo) {
        for (mine, theirs) in [
            (&mut self.granted, earlier.granted),
            (&mut self.unknown, earlier.unknown),
        ] {
            mine.extend(theirs);
            mine.sort();
            mine.dedup();
        }
    }
}

/// How a round of replies is judged.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rules {
    /// How many nodes must grant.
    pub quorum: usize,
    /// One node decides alone: its error is the round's error.
    pub sole: bool,
    /// Whether the lease has time left after the round took its time and the drift
    /// margin (see [`lease_left`]): a late grant, of one node or a majority, is no grant.
    pub valid: bool,
    /// The retry pause after a split vote, so that contenders fall out of lockstep.
    pub jitter: Duration,
}

/// Judges one round of acquire replies.
pub(crate) fn vote(replies: Vec<(NodeId, Result<Attempt>)>, rules: Rules) -> Vote {
    let fence_of = |r: &Result<Attempt>| match r {
        Ok(Attempt::Acquired { fence, .. }) => Some(*fence),
        _ => None,
    };
    let granted = replies
        .iter()
        .filter(|(_, r)| fence_of(r).is_some())
        .count();
    let total = replies.len();
    let won = granted >= rules.quorum;
    // Where our token may be, to be undone when the round is not ours: every node that
    // may hold it, including the ones whose reply was lost (`granting`: also those that
    // granted in time; a win keeps the others apart).
    let undo = |granting: bool| Undo {
        // Where the script took the lock: granted in time, or without enough replicas.
        granted: replies
            .iter()
            .filter(|(_, r)| match r {
                Ok(Attempt::Acquired { .. }) => granting,
                Ok(Attempt::Unacked { .. }) => true,
                _ => false,
            })
            .map(|(n, _)| n.clone())
            .collect(),
        // A reply lost, or a retry's after a lost one (the first send may land later).
        unknown: replies
            .iter()
            .filter(|(_, r)| match r {
                Ok(attempt) => attempt.resent(),
                Err(e) => may_have_run(e),
            })
            .map(|(n, _)| n.clone())
            .collect(),
    };
    if won && rules.valid {
        let fence = replies
            .iter()
            .filter_map(|(_, r)| fence_of(r))
            .max()
            .unwrap_or(0);
        // Either said by any granting node.
        let (others_wait, previous_lost) =
            replies
                .iter()
                .fold((false, false), |(wait, lost), (_, r)| match r {
                    Ok(Attempt::Acquired {
                        others_wait,
                        previous_lost,
                        ..
                    }) => (wait | others_wait, lost | previous_lost),
                    _ => (wait, lost),
                });
        let among = |keep: &dyn Fn(u64) -> bool| -> Vec<NodeId> {
            replies
                .iter()
                .filter(|(_, r)| fence_of(r).is_some_and(keep))
                .map(|(n, _)| n.clone())
                .collect()
        };
        // A node whose attempt may still land (its reply lost, or a retry's) may take the
        // lock again after the release, with our token: the release is looked at again.
        let stray = undo(false);
        return Vote::Won {
            others_wait,
            previous_lost,
            resent: !stray.unknown.is_empty(),
            fence,
            granted: among(&|_| true),
            behind: among(&|f| f < fence),
            stray,
        };
    }
    let undo = undo(true);
    if won {
        return Vote::Late { undo };
    }
    let errors = replies.iter().filter(|(_, r)| r.is_err()).count();
    if errors > total - rules.quorum.min(total) {
        let mut replies = replies;
        let first = replies
            .iter()
            .position(|(_, r)| r.is_err())
            .expect("errors counted");
        let Err(error) = replies.swap_remove(first).1 else {
            unreachable!("position found an error")
        };
        let error = if rules.sole {
            error
        } else {
            log::debug!("redlock round failed: {error}");
            Error::NoQuorum {
                granted,
                needed: rules.quorum,
                nodes: total,
            }
        };
        return Vote::Failed { error, undo };
    }
    let held: Vec<Option<Duration>> = replies
        .iter()
        .filter_map(|(_, r)| match r {
            Ok(Attempt::Held { pttl, .. }) => Some(*pttl),
            _ => None,
        })
        .collect();
    let pttl = held.iter().flatten().min().copied();
    if rules.sole || held.len() > total - rules.quorum {
        // Others hold enough nodes that we cannot win now: wait for their release events
        // (or their lease).
        return Vote::Held { hint: pttl, undo };
    }
    // A split vote (nobody has a majority): retry after the jitter.
    Vote::Held {
        hint: Some(pttl.map_or(rules.jitter, |p| p.min(rules.jitter))),
        undo,
    }
}

/// Whether a lease of `lease` granted by a round that began at `started` has time left
/// now, after the `drift` margin: the validity counts from before the request was sent.
/// On the lease clock (see `clock`): a suspend during the round counts.
pub(crate) fn lease_left(lease: Duration, started: Stamp, drift: Duration) -> bool {
    lease
        .checked_sub(started.elapsed() + drift)
        .is_some_and(|v| !v.is_zero())
}

/// One outcome of a release from the nodes' replies. `was_valid`: the lease had not run
/// out when the release began, so on one node a key that only a retry found gone was
/// deleted by our first attempt, and one that a retry found held by another token was
/// given up by it (deleted and taken since, or granted to the next waiter of the fair
/// queue): nobody else could have taken it while our lease lasted.
///
/// Not so on several nodes (Redlock): there one node may lose our key while the lease
/// runs (a restart empties it, which is also what breaks the connection and makes the
/// retry), or never have held it (its grant did not count). A retry's "gone" or "another
/// owner" there says only that our first attempt may have deleted the key: it never
/// counts towards the majority that makes a release. It counts as an unanswered node
/// does (so an error is returned when one is needed to tell), and with no error to
/// return the outcome errs on the safe side: not held until the unlock.
pub(crate) fn tally_release(
    replies: Vec<Result<ReleaseReply>>,
    was_valid: bool,
    quorum: usize,
) -> Result<Unlocked> {
    let count = |want: &[ReleaseReply]| {
        replies
            .iter()
            .filter(|r| matches!(r, Ok(x) if want.contains(x)))
            .count()
    };
    let retried = count(&[ReleaseReply::GoneAfterRetry, ReleaseReply::OtherAfterRetry]);
    let sole = replies.len() == 1;
    let released = count(&[ReleaseReply::Released, ReleaseReply::Passed])
        + if was_valid && sole { retried } else { 0 };
    let other = count(&[ReleaseReply::Other, ReleaseReply::OtherAfterRetry]);
    let needed = quorum.min(replies.len());
    if released >= needed {
        return Ok(Unlocked::Released);
    }
    // A node that did not answer may have released ours (Redlock: a node that answers
    // "gone" or "another owner" may be one whose grant never counted, and tells nothing
    // of the nodes that held ours): the lock was not ours only when the answers leave
    // too few nodes for a majority even if every unanswered one released it.
    let unknown = replies.iter().filter(|r| r.is_err()).count() + if sole { 0 } else { retried };
    if released + unknown >= needed
        && let Some(Err(e)) = replies.into_iter().find(|r| r.is_err())
    {
        return Err(e);
    }
    Ok(if other > 0 {
        Unlocked::HeldByOther
    } else {
        Unlocked::Expired
    })
}

/// What one round of extends, on the nodes that hold a lock, says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renewal {
    /// A majority (one node: that node) extended it.
    Renewed,
    /// Enough nodes said "not yours" that no majority can hold it.
    Lost(LostReason),
    /// Too few answers to tell (network errors): try again while the lease lasts.
    Unknown,
}

impl Renewal {
    /// The verdict from the replies of `holders` nodes: `ok` extended, `gone` had no key,
    /// `other` held another token; `quorum` of all nodes is needed; `redlock` says whether
    /// a loss is a lost majority rather than one node's answer.
    pub fn judge(
        (ok, gone, other): (usize, usize, usize),
        holders: usize,
        quorum: usize,
        redlock: bool,
    ) -> Renewal {
        let needed = quorum.min(holders);
        if ok >= needed {
            Renewal::Renewed
        } else if gone + other > holders.saturating_sub(needed) {
            Renewal::Lost(if redlock {
                LostReason::NoQuorum
            } else if other > 0 {
                LostReason::Stolen
            } else {
                LostReason::Deleted
            })
        } else {
            Renewal::Unknown
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u16) -> NodeId {
        NodeId::new(format!("127.0.0.1:{n}/0"))
    }

    fn io_error() -> Error {
        Error::Redis(redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "timed out",
        )))
    }

    fn rules(quorum: usize, sole: bool) -> Rules {
        Rules {
            quorum,
            sole,
            valid: true,
            jitter: Duration::from_millis(7),
        }
    }

    fn acquired(fence: u64) -> Result<Attempt> {
        Ok(Attempt::Acquired {
            fence,
            others_wait: false,
            previous_lost: false,
            resent: false,
        })
    }

    fn held(ms: u64) -> Result<Attempt> {
        Ok(Attempt::Held {
            pttl: Some(Duration::from_millis(ms)),
            resent: false,
        })
    }

    #[test]
    fn smoke() {
        let v = vote(vec![(id(1), acquired(5))], rules(1, true));
        assert!(matches!(v, Vote::Won { fence: 5, .. }));
    }

    #[test]
    fn one_node_held_waits_for_its_lease_and_undoes_nothing() {
        match vote(vec![(id(1), held(300))], rules(1, true)) {
            Vote::Held { hint, undo } => {
                assert_eq!(hint, Some(Duration::from_millis(300)));
                assert!(undo.is_empty());
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn one_node_error_is_the_error_and_the_key_may_be_ours() {
        match vote(vec![(id(1), Err(io_error()))], rules(1, true)) {
            Vote::Failed { error, undo } => {
                assert!(error.is_connection(), "{error:?}");
                assert_eq!(undo.unknown, vec![id(1)]);
                assert!(undo.granted.is_empty());
            }
            other => panic!("{other:?}"),
        }
    }

    /// A lost hold's majority and the next one share a node: the one node that saw the
    /// loss is enough to say so.
    #[test]
    fn a_loss_any_granting_node_saw_is_told() {
        let lost = Ok(Attempt::Acquired {
            fence: 8,
            others_wait: false,
            previous_lost: true,
            resent: false,
        });
        let replies = vec![(id(1), acquired(7)), (id(2), lost), (id(3), acquired(9))];
        assert!(matches!(
            vote(replies, rules(2, false)),
            Vote::Won {
                previous_lost: true,
                ..
            }
        ));
        let clean = vec![(id(1), acquired(7)), (id(3), acquired(9))];
        assert!(matches!(
            vote(clean, rules(2, false)),
            Vote::Won {
                previous_lost: false,
                ..
            }
        ));
    }

    /// A win keeps the nodes that may hold our token without granting (a lost reply, a
    /// grant without enough replicas), for the undo of a win given up after its raises.
    #[test]
    fn a_win_keeps_where_else_the_token_may_be() {
        let replies = vec![
            (id(1), acquired(10)),
            (id(2), acquired(7)),
            (id(3), Err(io_error())),
            (
                id(4),
                Ok(Attempt::Unacked {
                    acked: 0,
                    resent: false,
                }),
            ),
            (id(5), held(100)),
        ];
        match vote(replies, rules(2, false)) {
            Vote::Won { granted, stray, .. } => {
                assert_eq!(granted, vec![id(1), id(2)]);
                assert_eq!(stray.granted, vec![id(4)]);
                assert_eq!(stray.unknown, vec![id(3)]);
            }
            v => panic!("{v:?}"),
        }
    }

    /// A node that granted a retry after a lost reply is given back now (it granted) and
    /// looked at again later (the first send may land after that), also once the round's
    /// undo took in an earlier one's.
    #[test]
    fn a_node_granting_a_retry_stays_among_those_looked_at_again() {
        let resent = Ok(Attempt::Acquired {
            fence: 7,
            others_wait: false,
            previous_lost: false,
            resent: true,
        });
        let replies = vec![
            (id(1), resent),
            (id(2), Err(io_error())),
            (id(3), Err(io_error())),
        ];
        let Vote::Failed { mut undo, .. } = vote(replies, rules(2, false)) else {
            panic!("two nodes of three failed")
        };
        let earlier = Undo {
            granted: vec![],
            unknown: vec![id(2)],
        };
        undo.absorb(earlier);
        assert_eq!(undo.granted, vec![id(1)]);
        assert_eq!(undo.unknown, vec![id(1), id(2), id(3)]);
    }

    #[test]
    fn a_majority_wins_with_the_highest_fence_and_raises_the_others() {
        let replies = vec![
            (id(1), acquired(7)),
            (id(2), held(100)),
            (id(3), acquired(9)),
        ];
        match vote(replies, rules(2, false)) {
            Vote::Won {
                fence,
                granted,
                behind,
                ..
            } => {
                assert_eq!(fence, 9);
                assert_eq!(granted, vec![id(1), id(3)]);
                assert_eq!(behind, vec![id(1)]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_late_majority_is_no_majority() {
        let replies = vec![
            (id(1), acquired(1)),
            (id(2), acquired(1)),
            (id(3), held(50)),
        ];
        let late = Rules {
            valid: false,
            ..rules(2, false)
        };
        match vote(replies, late) {
            Vote::Late { undo } => assert_eq!(undo.granted, vec![id(1), id(2)]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_late_grant_of_one_node_is_no_grant() {
        let late = Rules {
            valid: false,
            ..rules(1, true)
        };
        match vote(vec![(id(1), acquired(4))], late) {
            Vote::Late { undo } => assert_eq!(undo.granted, vec![id(1)]),
            other => panic!("{other:?}"),
        }
        let now = Stamp::now();
        assert!(lease_left(
            Duration::from_secs(1),
            now,
            Duration::from_millis(12)
        ));
        assert!(!lease_left(
            Duration::from_millis(10),
            now,
            Duration::from_millis(12)
        ));
    }

    #[test]
    fn too_many_errors_is_no_quorum_with_the_count_granted() {
        let replies = vec![
            (id(1), acquired(3)),
            (id(2), Err(io_error())),
            (id(3), Err(io_error())),
        ];
        match vote(replies, rules(2, false)) {
            Vote::Failed { error, undo } => {
                assert!(matches!(
                    error,
                    Error::NoQuorum {
                        granted: 1,
                        needed: 2,
                        nodes: 3
                    }
                ));
                assert_eq!(undo.granted, vec![id(1)]);
                assert_eq!(undo.unknown, vec![id(2), id(3)]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_split_vote_retries_after_the_jitter() {
        let replies = vec![
            (id(1), acquired(3)),
            (id(2), held(5000)),
            (id(3), Err(io_error())),
        ];
        match vote(replies, rules(2, false)) {
            Vote::Held { hint, undo } => {
                assert_eq!(hint, Some(Duration::from_millis(7)));
                assert_eq!(undo.granted, vec![id(1)]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn held_by_a_majority_waits_for_the_shortest_lease() {
        let replies = vec![(id(1), held(900)), (id(2), held(400)), (id(3), acquired(1))];
        match vote(replies, rules(2, false)) {
            Vote::Held { hint, .. } => assert_eq!(hint, Some(Duration::from_millis(400))),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn release_tally() {
        use ReleaseReply::*;
        let ok = |r| Ok(r);
        assert_eq!(
            tally_release(vec![ok(Released)], true, 1).unwrap(),
            Unlocked::Released
        );
        // A retry that found the key gone: our first attempt deleted it, if the lease
        // was still running.
        assert_eq!(
            tally_release(vec![ok(GoneAfterRetry)], true, 1).unwrap(),
            Unlocked::Released
        );
        assert_eq!(
            tally_release(vec![ok(GoneAfterRetry)], false, 1).unwrap(),
            Unlocked::Expired
        );
        assert_eq!(
            tally_release(vec![ok(Other)], true, 1).unwrap(),
            Unlocked::HeldByOther
        );
        // A retry that found another token: our first attempt released it (or, with the
        // fair queue, granted it to the next waiter) while the lease was still running.
        assert_eq!(
            tally_release(vec![ok(OtherAfterRetry)], true, 1).unwrap(),
            Unlocked::Released
        );
        assert_eq!(
            tally_release(vec![ok(OtherAfterRetry)], false, 1).unwrap(),
            Unlocked::HeldByOther
        );
        assert_eq!(
            tally_release(vec![ok(Released), ok(Gone), ok(Released)], true, 2).unwrap(),
            Unlocked::Released
        );
        assert_eq!(
            tally_release(vec![ok(Released), ok(Gone), ok(Other)], true, 2).unwrap(),
            Unlocked::HeldByOther
        );
        // Too few answers: the first error.
        let e = tally_release(
            vec![ok(Released), Err(io_error()), Err(io_error())],
            true,
            2,
        )
        .unwrap_err();
        assert!(e.is_connection());
        // One released, one unanswered: the answers of the third (a node whose grant never
        // counted, say) cannot make it another's or expired; unknown, the error.
        for third in [Other, Gone] {
            let e =
                tally_release(vec![ok(Released), Err(io_error()), ok(third)], true, 2).unwrap_err();
            assert!(e.is_connection(), "{third:?}");
        }
        // Two nodes say it was not ours: no majority held it, whatever the third did.
        assert_eq!(
            tally_release(vec![ok(Gone), Err(io_error()), ok(Other)], true, 2).unwrap(),
            Unlocked::HeldByOther
        );
        // Several nodes: a retry's answer may be a node that lost our key (a restart) or
        // never held it; with the first delete, no majority is known to have released.
        assert_eq!(
            tally_release(
                vec![ok(Released), ok(GoneAfterRetry), ok(GoneAfterRetry)],
                true,
                2
            )
            .unwrap(),
            Unlocked::Expired
        );
        assert_eq!(
            tally_release(vec![ok(Released), ok(OtherAfterRetry), ok(Gone)], true, 2).unwrap(),
            Unlocked::HeldByOther
        );
        // ... nor can it make an unanswered node's outcome definite.
        let e = tally_release(
            vec![ok(Released), ok(GoneAfterRetry), Err(io_error())],
            true,
            2,
        )
        .unwrap_err();
        assert!(e.is_connection());
        assert_eq!(
            tally_release(
                vec![ok(Released), ok(GoneAfterRetry), ok(Released)],
                true,
                2
            )
            .unwrap(),
            Unlocked::Released
        );
    }

    #[test]
    fn renewal_verdicts() {
        use LostReason::*;
        let one = |t| Renewal::judge(t, 1, 1, false);
        assert_eq!(one((1, 0, 0)), Renewal::Renewed);
        assert_eq!(one((0, 1, 0)), Renewal::Lost(Deleted));
        assert_eq!(one((0, 0, 1)), Renewal::Lost(Stolen));
        assert_eq!(one((0, 0, 0)), Renewal::Unknown);
        let five = |t| Renewal::judge(t, 5, 3, true);
        assert_eq!(five((3, 2, 0)), Renewal::Renewed);
        assert_eq!(five((2, 2, 0)), Renewal::Unknown);
        assert_eq!(five((2, 2, 1)), Renewal::Lost(NoQuorum));
        // Held on 3 of 5: all three must still be ours.
        assert_eq!(
            Renewal::judge((2, 1, 0), 3, 3, true),
            Renewal::Lost(NoQuorum)
        );
        assert_eq!(Renewal::judge((2, 0, 0), 3, 3, true), Renewal::Unknown);
    }
}
