//! A lock held in Redis by this process: its token, fence, validity and lost state. Shared
//! by the guard(s) that hold it in turn (the baton) and the watchdog.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use parking_lot::{Condvar, Mutex};

use crate::clock::Stamp;
use crate::error::LostReason;
use crate::proto::keys::Keys;
use crate::proto::node::NodeId;
use crate::proto::protocol::Protocol;
use crate::stats::{Counters, Path};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) struct RemoteLock {
    pub id: u64,
    pub keys: Keys,
    /// The owner token in Redis: a random UUID v4 per remote acquisition.
    pub token: String,
    /// The Redis fencing counter of this acquisition (Redlock: the highest of the nodes
    /// that granted it).
    pub fence: u64,
    /// The hold before this acquisition ended without a release (its lease ran out, its
    /// key was deleted), as the fence counter said (Redlock: on any node that granted).
    /// What the first holder is told; a local handoff passes the hold on cleanly.
    pub previous_lost: bool,
    /// The nodes that granted the lock.
    pub nodes: Vec<NodeId>,
    /// When the acquisition round began, for comparing with other `Instant`s (when a
    /// subscription was confirmed).
    pub acquired_at: Instant,
    /// When the hold reaches its cap (`max_hold`, counted from the acquisition in Redis,
    /// so local holders it is handed to inherit it): then it is lost (`HoldLimit`), and
    /// renewals stop. Far in the future without a cap.
    hold_limit: Stamp,
    /// Renewed by the watchdog (else only watched until it expires).
    renews: bool,
    /// Won by a retry after a lost reply: the first send may land after the release and
    /// take the lock again with this token, so the release is looked at again (see
    /// `cleanup`).
    resent: AtomicBool,
    /// The holds of ours this one was turned from (an upgradable read into the write hold,
    /// a write hold into the read hold) that were won so, or turned from such, each with
    /// how it was held: the first send of their attempt may land after this hold's
    /// release and take them again with their member, which the turn retired. Looked at
    /// again with this hold's release.
    turned_from: Mutex<Vec<(Protocol, String)>>,
    /// How it is held in Redis, which says how it is released and renewed.
    pub protocol: Protocol,
    state: Mutex<State>,
    renew_done: Condvar,
}

/// Times are on the lease clock (see `clock`): a lease is judged there.
struct State {
    lease: Duration,
    valid_until: Stamp,
    next_renew: Stamp,
    renewing: bool,
    /// The holder waits to extend: the watchdog starts no renewal meanwhile.
    extend_waiting: bool,
    /// The number of the last lease change handed out (renewal or extend; 0: the
    /// acquisition's lease). Redis refuses a change older than one it applied (see
    /// `renewal::EXTEND`).
    changes: u64,
    released: bool,
    lost: Option<LostReason>,
    /// The current holder's lost channel.
    listener: Option<Sender<LostReason>>,
    /// The lost channels of holders that share the lock at once (local readers), by id.
    sharers: Vec<(u64, Sender<LostReason>)>,
}

/// What the watchdog should do with a lock now.
pub(crate) enum Due {
    /// Released or lost: forget it.
    Forget,
    /// Not yet: look again at this time.
    At(Stamp),
    /// Renew now with this lease, as change number `seq`; `renewing` is set until
    /// [`RemoteLock::end_renew`].
    Renew { lease: Duration, seq: u64 },
}

/// How a lease change (a renewal or an extend) ended.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Changed {
    /// Applied: the lock is valid until `valid_until` (sent at + lease − drift); the next
    /// renewal is due at `next_renew`.
    Applied {
        valid_until: Stamp,
        next_renew: Stamp,
    },
    /// The replies prove the lock gone.
    Lost(LostReason),
    /// No telling (no reply, too few answers, or refused as stale): the change may have
    /// been applied, so the lock is valid at most until `cap` (sent at + lease − drift);
    /// retry at `retry_at`.
    Unknown { cap: Stamp, retry_at: Stamp },
}

/// What a successful acquisition round produced.
pub(crate) struct Acquisition {
    pub keys: Keys,
    pub protocol: Protocol,
    pub token: String,
    pub fence: u64,
    pub previous_lost: bool,
    pub nodes: Vec<NodeId>,
    /// When the round began, on the lease clock: validity counts from here, not from the
    /// reply.
    pub started: Stamp,
}

impl RemoteLock {
    /// Won by a retry after a lost reply (see the field).
    pub fn set_resent(&self, resent: bool) {
        self.resent.store(resent, Ordering::Relaxed);
    }

    /// Whether it was won by a retry after a lost reply (see the field).
    pub fn resent(&self) -> bool {
        self.resent.load(Ordering::Relaxed)
    }

    /// This hold was turned from `from` (see the field).
    pub fn set_turned_from(&self, from: &RemoteLock) {
        let mut earlier = from.turned_from();
        if from.resent() {
            earlier.push((from.protocol, from.token.clone()));
        }
        *self.turned_from.lock() = earlier;
    }

    /// The holds this one was turned from that an attempt may still take (see the field).
    pub fn turned_from(&self) -> Vec<(Protocol, String)> {
        self.turned_from.lock().clone()
    }

    /// This hold, made of `from` (a write hold turned into a read hold), keeps `from`'s
    /// cap: the cap counts from the acquisition in Redis, which a conversion does not
    /// renew.
    pub fn capped_as(mut self, from: &RemoteLock) -> Self {
        self.hold_limit = self.hold_limit.min(from.hold_limit);
        self
    }

    pub fn new(
        won: Acquisition,
        lease: Duration,
        drift: Duration,
        renew_every: Option<Duration>,
        max_hold: Option<Duration>,
    ) -> Self {
        let started = won.started;
        RemoteLock {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            keys: won.keys,
            token: won.token,
            fence: won.fence,
            previous_lost: won.previous_lost,
            nodes: won.nodes,
            acquired_at: started.to_instant(),
            hold_limit: started + max_hold.unwrap_or(Duration::MAX),
            renews: renew_every.is_some(),
            resent: AtomicBool::new(false),
            turned_from: Mutex::new(Vec::new()),
            protocol: won.protocol,
            state: Mutex::new(State {
                lease,
                valid_until: started + lease - drift,
                next_renew: started + renew_every.unwrap_or(lease),
                renewing: false,
                extend_waiting: false,
                changes: 0,
                released: false,
                lost: None,
                listener: None,
                sharers: Vec::new(),
            }),
            renew_done: Condvar::new(),
        }
    }

    /// What a holder that got this hold by `path` is told of the hold before it (see
    /// `LockGuard::previous_lost`): the acquisition's news for the thread that took it
    /// from Redis; nothing for a local handoff, which passes the hold on cleanly.
    pub fn previous_lost_for(&self, path: Path) -> bool {
        path == Path::Remote && self.previous_lost
    }

    /// A hold taken from a fair queue's grant message, with no confirming attempt: surely
    /// held only until `valid_until` (the grant lease from the send of the attempt the
    /// grant followed), and due for its first renewal at `renew_at`, which gives it the
    /// full lease (see `Config::first_renewal`).
    pub fn granted_until(self, valid_until: Stamp, renew_at: Stamp) -> Self {
        {
            let mut st = self.state.lock();
            st.valid_until = st.valid_until.min(valid_until);
            st.next_renew = renew_at.min(st.valid_until);
        }
        self
    }

    /// When the watchdog should look at this lock next.
    pub fn next_due(&self) -> Stamp {
        self.next_look(&self.state.lock())
    }

    /// The next renewal (with renewals off: the end of the validity), or the end of the
    /// validity or the hold's cap if that comes first: a retry planned past the end (a
    /// renewal that failed late in the lease) must not make the holder learn of the loss
    /// late.
    fn next_look(&self, st: &State) -> Stamp {
        let next = if self.renews {
            st.next_renew.min(st.valid_until)
        } else {
            st.valid_until
        };
        next.min(self.hold_limit)
    }

    /// Marks the lock lost if it is known to be at `now` and not marked yet: its validity
    /// has ended (`Expired`), or its cap has passed (`HoldLimit`); when both have (nobody
    /// looked meanwhile: the process was paused), for the one that came first.
    fn lost_by(&self, st: &mut State, now: Stamp, counters: &Counters) {
        if st.lost.is_some() {
            return;
        }
        let (end, reason) = match self.hold_limit < st.valid_until {
            true => (self.hold_limit, LostReason::HoldLimit),
            false => (st.valid_until, LostReason::Expired),
        };
        if now >= end {
            Self::set_lost(st, reason, counters);
        }
    }

    /// Until when the lock is surely held, as an `Instant` (the public API's, and a bound
    /// for waits): the end of its lease, or its cap if that comes first (from the cap on
    /// the hold is lost, whatever its lease says).
    pub fn valid_until(&self) -> Instant {
        self.validity().min(self.hold_limit).to_instant()
    }

    /// Until when the lock's lease surely lasts, on the lease clock (its cap aside).
    pub fn validity(&self) -> Stamp {
        self.state.lock().valid_until
    }

    /// Why the lock is lost, if it is. Past its validity, or its cap, a lock is lost even
    /// if the watchdog has not run yet (the process was paused, say, or the watchdog's next
    /// pass is a moment away).
    pub fn lost(&self, counters: &Counters) -> Option<LostReason> {
        let mut st = self.state.lock();
        if !st.released {
            self.lost_by(&mut st, Stamp::now(), counters);
        }
        st.lost
    }

    /// Marks the lock lost (once) and tells the current holder.
    pub fn mark_lost(&self, reason: LostReason, counters: &Counters) {
        let mut st = self.state.lock();
        if st.lost.is_none() && !st.released {
            Self::set_lost(&mut st, reason, counters);
        }
    }

    fn set_lost(st: &mut State, reason: LostReason, counters: &Counters) {
        st.lost = Some(reason);
        // A hold known lost is surely held no longer: its validity ends now, whatever
        // was left of its lease (another holder may be in already).
        st.valid_until = st.valid_until.min(Stamp::now());
        // The holders first: the logger and the metrics recorder below are the user's code,
        // and a panic there must not keep them from being told.
        if let Some(tx) = st.listener.take() {
            let _ = tx.try_send(reason);
        }
        for (_, tx) in st.sharers.drain(..) {
            let _ = tx.try_send(reason);
        }
        counters.lost(reason);
        log::warn!("lock lost: {reason}");
    }

    /// Adds the lost channel of one of the holders that share the lock at once.
    pub fn add_sharer(&self, id: u64, tx: Sender<LostReason>) {
        let mut st = self.state.lock();
        match st.lost {
            Some(reason) => {
                let _ = tx.try_send(reason);
            }
            None => st.sharers.push((id, tx)),
        }
    }

    /// Removes a sharing holder's lost channel (it let go).
    pub fn remove_sharer(&self, id: u64) {
        self.state.lock().sharers.retain(|(i, _)| *i != id);
    }

    /// Installs the lost channel of a new holder (first acquisition or handoff).
    pub fn set_listener(&self, tx: Sender<LostReason>) {
        let mut st = self.state.lock();
        match st.lost {
            Some(reason) => {
                let _ = tx.try_send(reason);
            }
            None => st.listener = Some(tx),
        }
    }

    /// Stops renewals for good before the release is sent: waits for a renewal in flight,
    /// so that none is ever sent after the caller's unlock returns. Returns whether the
    /// lock was already lost.
    pub fn begin_release(&self, counters: &Counters) -> Option<LostReason> {
        let mut st = self.state.lock();
        // Say so before waiting: a watchdog that finishes one renewal must not start the
        // next before we get the mutex back (with a hung node it always has one due).
        st.released = true;
        while st.renewing {
            self.renew_done.wait(&mut st);
        }
        self.lost_by(&mut st, Stamp::now(), counters);
        st.listener = None;
        st.sharers.clear();
        st.lost
    }

    /// The watchdog's question: renew now, later, or never.
    pub fn due(&self, now: Stamp, horizon: Stamp, counters: &Counters) -> Due {
        let mut st = self.state.lock();
        if st.released || st.lost.is_some() {
            return Due::Forget;
        }
        // By the clock first, also while the holder's own extend is under way: it may wait
        // on a hung node past the end of the validity.
        self.lost_by(&mut st, now, counters);
        if st.lost.is_some() {
            return Due::Forget;
        }
        if st.renewing || st.extend_waiting {
            // The holder is extending it right now: look again shortly.
            return Due::At(now + Duration::from_millis(10));
        }
        if !self.renews || st.next_renew > horizon {
            return Due::At(self.next_look(&st));
        }
        st.renewing = true;
        st.changes += 1;
        Due::Renew {
            lease: st.lease,
            seq: st.changes,
        }
    }

    /// Ends a renewal started by [`due`](Self::due).
    pub fn end_renew(&self, outcome: Changed, counters: &Counters) {
        let mut st = self.state.lock();
        st.renewing = false;
        // Before the outcome is applied: telling a loss runs the user's logger and metrics
        // recorder, and a panic there must not leave an unlock or an extend waiting for
        // ever (the waiters wake when the mutex is let go, also by the unwinding).
        self.renew_done.notify_all();
        Self::apply(&mut st, outcome, counters);
    }

    /// What a lease change's outcome does to the lock's state (see `renewal::EXTEND` for
    /// the rule).
    fn apply(st: &mut State, outcome: Changed, counters: &Counters) {
        match outcome {
            Changed::Applied {
                valid_until,
                next_renew,
            } => {
                // Not the later of the old and the new: a shorter lease that was applied
                // is the lease. A hold known lost stays lost: its validity has ended.
                if st.lost.is_none() {
                    st.valid_until = valid_until;
                }
                st.next_renew = next_renew;
            }
            Changed::Lost(reason) => {
                if st.lost.is_none() && !st.released {
                    Self::set_lost(st, reason, counters);
                }
            }
            Changed::Unknown { cap, retry_at } => {
                st.valid_until = st.valid_until.min(cap);
                st.next_renew = retry_at;
            }
        }
    }

    /// A lease change of the holder's, still in flight, may have set the lease to end at
    /// `cap` (before it is retried): the validity ends by then at the latest.
    pub fn cap_validity(&self, cap: Stamp) {
        let mut st = self.state.lock();
        st.valid_until = st.valid_until.min(cap);
    }

    /// Before an explicit extend: waits for a renewal in flight and keeps the watchdog
    /// out until [`end_extend`](Self::end_extend), so that the changes of one hold are
    /// sent one at a time. Returns the extend's change number.
    pub fn begin_extend(&self) -> u64 {
        let mut st = self.state.lock();
        st.extend_waiting = true;
        while st.renewing {
            self.renew_done.wait(&mut st);
        }
        st.extend_waiting = false;
        st.renewing = true;
        st.changes += 1;
        st.changes
    }

    /// A lease change begun with [`begin_extend`](Self::begin_extend) that was not sent
    /// after all: the lease, the validity and the next renewal stay as they were.
    pub fn cancel_extend(&self) {
        self.state.lock().renewing = false;
        self.renew_done.notify_all();
    }

    /// After an explicit extend to `lease`: its outcome. The watchdog goes on with the new
    /// lease unless the lock is lost, also when the outcome is unknown (the change may
    /// have been applied; the next renewal, sent soon, applies it for sure).
    pub fn end_extend(&self, lease: Duration, outcome: Changed, counters: &Counters) {
        let mut st = self.state.lock();
        st.renewing = false;
        st.lease = lease;
        // Before the outcome is applied, as in `end_renew`.
        self.renew_done.notify_all();
        Self::apply(&mut st, outcome, counters);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::node::NodeId;

    /// A hold taken `ago`, with a `lease` and a cap of `max_hold`.
    fn taken(ago: Duration, lease: Duration, max_hold: Duration) -> RemoteLock {
        let won = Acquisition {
            keys: Keys::new("t:", b"held").expect("keys"),
            protocol: Protocol::Lock {
                mark_ttl: Duration::from_secs(1),
            },
            token: "token".to_owned(),
            fence: 1,
            previous_lost: false,
            nodes: vec![NodeId::new("node")],
            started: Stamp::now() - ago,
        };
        RemoteLock::new(won, lease, Duration::ZERO, None, Some(max_hold))
    }

    /// A hold looked at only after both its lease and its cap have passed (the process was
    /// paused) is lost for whichever came first.
    #[test]
    fn a_hold_past_its_lease_and_its_cap_is_lost_for_the_first_of_them() {
        let counters = Counters::default();
        let s = Duration::from_secs;
        let capped_first = taken(s(10), s(5), s(2));
        assert_eq!(capped_first.lost(&counters), Some(LostReason::HoldLimit));
        let expired_first = taken(s(10), s(2), s(5));
        assert_eq!(expired_first.lost(&counters), Some(LostReason::Expired));
        let within_both = taken(s(1), s(5), s(5));
        assert_eq!(within_both.lost(&counters), None);
    }
}
