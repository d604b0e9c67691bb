//! The local table: for each key some thread of this process holds or wants, who holds it,
//! who contends for it in Redis, and the FIFO queue of local waiters (singleflight).
//!
//! Every change of an entry, and every grant to a queued waiter, happens under the table's
//! one mutex. That is what makes the races simple: a waiter whose deadline passes takes the
//! same mutex to leave the queue, so it either finds its grant already there (and takes
//! it) or leaves before any grant can be made to it; a lock is never handed to a thread
//! that has gone.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::fencing::MAX_LOCAL_SEQ;
use crate::local::held::RemoteLock;
use crate::local::mailbox::{Cancellation, Grant, Permit, SPIN_MAX_HOLD, Slot};
use crate::local::spin_choice::SpinChoice;
use crate::proto::keys::Keys;
use crate::proto::node::NodeId;

/// What the table asks a node's event listener about remote contention. The listener
/// lives in a higher layer (the subscriber of `wake`); this trait is how the table reaches
/// it without naming it.
pub(crate) trait Probe {
    /// The node this listener hears.
    fn node(&self) -> &NodeId;
    /// Keeps `keys` subscribed while the returned value lives, so that the holder's
    /// process hears when a remote process fails to get the lock.
    fn interest(&self, keys: &Keys) -> Box<dyn Send>;
    /// Whether another process failed to get `keys` within the last `window`.
    fn heard_mark_within(&self, keys: &Keys, window: Duration) -> bool;
    /// Whether remote contention can be heard on this node at all.
    fn hears_marks(&self) -> bool;
    /// When the key's current subscription was confirmed (`None`: it is not).
    fn confirmed_at(&self, keys: &Keys) -> Option<Instant>;
}

/// What `enter` decided for the calling thread.
pub(crate) enum Role {
    Contend,
    /// Wait in the local queue. `check_marks`: this waiter started the key's subscription
    /// behind a holder, so it should look for marks left before the subscription was
    /// confirmed ([`Table::marks_checked`]).
    Queued {
        slot: Arc<Slot>,
        check_marks: bool,
    },
}

/// Whether another process is waiting for a key we hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Others {
    /// No: a process alone hands off freely.
    No,
    /// Cannot tell yet (subscription or mark check pending): apply the budget, but do not
    /// make our next contender wait for a waiter that may not exist.
    Unknown,
    /// Yes: apply the budget, and let them go first.
    Waiting,
}

/// What a release must do.
pub(crate) enum Step {
    /// Handed to the next local waiter: nothing to send.
    HandedOff,
    /// Release in Redis, then call [`Table::released`]. `forced`: why, when local waiters
    /// remain. `contended`: another thread or process is known to want the lock, so this
    /// process's next contender should let it go first.
    Remote {
        forced: Option<Forced>,
        contended: bool,
    },
}

/// Why a release goes to Redis though local threads wait for the lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Forced {
    /// The fairness budget is spent while another process waits (or may wait).
    Budget,
    /// One remote acquisition served all the local handoffs a token can number
    /// (`MAX_LOCAL_SEQ`): the lock goes back through Redis for a new fence, also in a
    /// process alone on the key.
    Handoffs,
}

struct Entry {
    holder: Option<ThreadId>,
    /// The id of the remote lock the holder holds (`RemoteLock::id`): a thread that won
    /// the key anew while the guard of its earlier, lost hold still lives has two guards,
    /// and only the current hold's guard may change the entry.
    hold: Option<u64>,
    contenders: usize,
    releasing: bool,
    /// Threads that held the key here when another thread won it anew in Redis (without
    /// the local handoff every thread contends there, and one may win once a local
    /// holder's key was deleted or expired): their guards still live, and their release
    /// must leave the current holder's state alone.
    unseated: Vec<ThreadId>,
    queue: VecDeque<Arc<Slot>>,
    /// Handoff number within the current remote acquisition (low bits of the fence).
    seq: u32,
    /// When the current remote acquisition began (the budget's time slice).
    acquired_at: Instant,
    /// When the round that won it began (`RemoteLock::acquired_at`): a subscription
    /// confirmed by then heard every other process that failed to get it since.
    round_at: Instant,
    /// Keeps the key subscribed while local threads queue behind a holder, so that the
    /// holder hears when a remote process fails to get the lock: per node of the key's
    /// route, as last seen (see `Entry::follow`).
    interests: Vec<(NodeId, Box<dyn Send>)>,
    /// Per node: the subscription (by its confirmation time) after whose confirmation the
    /// mark key was read; marks before it are then known too.
    checked: Vec<(NodeId, Instant)>,
    /// When a mark check found another process's mark.
    marked_at: Option<Instant>,
    /// When the current local holder got the lock, and the average local hold: the next
    /// waiter is told when to expect the release (see `slot`).
    held_since: Instant,
    hold_avg: Option<Duration>,
    /// Whether telling the head to spin pays for this key (see `spin_choice`).
    spin: SpinChoice,
}

impl Entry {
    fn new() -> Self {
        Entry {
            holder: None,
            hold: None,
            contenders: 0,
            releasing: false,
            unseated: Vec::new(),
            queue: VecDeque::new(),
            seq: 0,
            acquired_at: Instant::now(),
            round_at: Instant::now(),
            interests: Vec::new(),
            checked: Vec::new(),
            marked_at: None,
            held_since: Instant::now(),
            hold_avg: None,
            spin: SpinChoice::new(),
        }
    }

    fn others<P: Probe>(&self, remote: &RemoteLock, subs: &[P], window: Duration) -> Others {
        if subs.is_empty() || self.marked_at.is_some_and(|t| t.elapsed() < window) {
            return Others::Waiting;
        }
        let mut unknown = false;
        for s in subs {
            if s.heard_mark_within(&remote.keys, window) {
                return Others::Waiting;
            }
            if !s.hears_marks() {
                return Others::Waiting;
            }
            let known = s.confirmed_at(&remote.keys).is_some_and(|at| {
                at <= remote.acquired_at
                    || self.checked.iter().any(|(n, t)| n == s.node() && *t == at)
            });
            unknown |= !known;
        }
        if unknown { Others::Unknown } else { Others::No }
    }

    /// Keeps the key subscribed on the nodes of `subs`, the key's route now: the first
    /// time, and again when the route changed (a Redis Cluster slot that moved to another
    /// master). A queue can live for as long as the key stays hot, and its subscription
    /// must follow the key: on the master left behind it would hear nothing of the key,
    /// and keep that master's subscriber trying to reach a node that may be gone. Whether
    /// it subscribed anew (marks left before the new subscription are then unknown).
    fn follow<P: Probe>(&mut self, keys: &Keys, subs: &[P]) -> bool {
        let same = self.interests.len() == subs.len()
            && self
                .interests
                .iter()
                .zip(subs)
                .all(|((n, _), s)| n == s.node());
        if same || subs.is_empty() {
            return false;
        }
        // The new subscriptions are asked for before the old ones are let go.
        let new = subs
            .iter()
            .map(|s| (s.node().clone(), s.interest(keys)))
            .collect();
        drop(std::mem::replace(&mut self.interests, new));
        self.checked
            .retain(|(n, _)| subs.iter().any(|s| s.node() == n));
        true
    }

    /// Folds the hold that just ended into the average (weight 1/8), and returns it.
    fn note_hold(&mut self) -> Duration {
        let hold = self.held_since.elapsed();
        self.hold_avg = Some(self.hold_avg.map_or(hold, |a| (a * 7 + hold) / 8));
        hold
    }

    /// Tells the head of the queue when the new hold is expected to end, if holds are
    /// short enough for it to be worth spinning for, spinning pays for this key, and this
    /// process has a core to spare for it (`active`: the keys this process is busy with;
    /// see `slot`).
    fn tell_next(&self, active: usize) {
        if let (Some(next), Some(avg)) = (self.queue.front(), self.hold_avg)
            && avg <= SPIN_MAX_HOLD
            && self.spin.spin()
            && let Some(permit) = Permit::try_take(active)
        {
            next.expect_release(self.held_since + avg, permit);
        }
    }

    fn idle(&self) -> bool {
        self.holder.is_none()
            && self.contenders == 0
            && !self.releasing
            && self.unseated.is_empty()
            && self.queue.is_empty()
    }

    /// Wakes the first queued waiter as the process's contender.
    fn promote(&mut self, yield_first: bool) {
        if let Some(slot) = self.queue.pop_front() {
            self.contenders += 1;
            slot.give(Grant::Contend { yield_first });
        }
    }
}

#[derive(Default)]
pub(crate) struct Table {
    map: Mutex<HashMap<Vec<u8>, Entry>>,
}

impl Table {
    /// Registers the calling thread's interest in `keys`: it either contends in Redis
    /// itself, or queues behind the local holder/contender (`handoff`).
    pub fn enter<P: Probe>(
        &self,
        keys: &Keys,
        wait: bool,
        handoff: bool,
        subs: &[P],
    ) -> Result<Role> {
        let me = std::thread::current().id();
        let mut map = self.map.lock();
        // Only a queued waiter uses it, and it queues behind an entry that already exists.
        let active = map.len();
        let entry = map.entry(keys.lock().to_vec()).or_insert_with(Entry::new);
        if entry.holder == Some(me) {
            return Err(Error::WouldDeadlock);
        }
        let busy = entry.holder.is_some() || entry.contenders > 0 || entry.releasing;
        if !(handoff && busy) {
            entry.contenders += 1;
            return Ok(Role::Contend);
        }
        if !wait {
            return Err(Error::WouldBlock);
        }
        let check_marks = entry.follow(keys, subs);
        let slot = Arc::new(Slot::new(me));
        entry.queue.push_back(slot.clone());
        if entry.queue.len() == 1 && entry.holder.is_some() {
            entry.tell_next(active);
        }
        Ok(Role::Queued { slot, check_marks })
    }

    /// Waits in the local queue for the baton or the duty to contend, until `deadline` or
    /// until `cancel` is set ([`Error::Cancelled`]; a grant that came first is taken).
    pub fn wait_queued(
        &self,
        keys: &Keys,
        slot: &Arc<Slot>,
        deadline: Option<Instant>,
        cancel: Option<&Arc<Cancellation>>,
    ) -> Result<Grant> {
        let _woken = cancel.map(|c| {
            let slot = slot.clone();
            c.on_cancel(move || slot.poke())
        });
        if let Some(g) = slot.wait(deadline, cancel.map(|c| &**c)) {
            return Ok(g);
        }
        // Deadline passed (or the wait was cancelled): leave the queue under the table
        // lock, unless a grant won the race.
        let mut map = self.map.lock();
        if let Some(g) = slot.take() {
            return Ok(g);
        }
        if let Some(entry) = map.get_mut(keys.lock()) {
            entry.queue.retain(|s| !Arc::ptr_eq(s, slot));
            if entry.idle() {
                map.remove(keys.lock());
            }
        }
        if cancel.is_some_and(|c| c.is_cancelled()) {
            Err(Error::Cancelled)
        } else {
            Err(Error::Timeout)
        }
    }

    /// Records a mark check on node `node`: the mark key was read after the subscription
    /// confirmed at `confirmed_at`; `foreign` if another process's mark was there.
    pub fn marks_checked(&self, keys: &Keys, node: &NodeId, confirmed_at: Instant, foreign: bool) {
        let mut map = self.map.lock();
        if let Some(entry) = map.get_mut(keys.lock()) {
            entry.checked.retain(|(n, _)| n != node);
            entry.checked.push((node.clone(), confirmed_at));
            if foreign {
                entry.marked_at = Some(Instant::now());
            }
        }
    }

    /// Whether marks left before a subscription confirmed at `confirmed_at` need no look:
    /// it was confirmed before the round that won the current hold began, so every other
    /// process that failed to get the lock since published its mark to it, and the holder
    /// counts it as known (see `Entry::others`).
    pub fn marks_heard_since(&self, keys: &Keys, confirmed_at: Instant) -> bool {
        let map = self.map.lock();
        map.get(keys.lock())
            .is_some_and(|e| e.holder.is_some() && confirmed_at <= e.round_at)
    }

    /// A waiter that was granted the duty to contend but gives up before contending
    /// (its deadline passed in the same instant): pass the duty on.
    pub fn contend_failed(&self, keys: &Keys) {
        let mut map = self.map.lock();
        let Some(entry) = map.get_mut(keys.lock()) else {
            return;
        };
        entry.contenders -= 1;
        if entry.holder.is_none() && entry.contenders == 0 && !entry.releasing {
            entry.promote(false);
        }
        if entry.idle() {
            map.remove(keys.lock());
        }
    }

    /// The calling thread, a contender, got the lock `id` (`RemoteLock::id`) in Redis.
    pub fn acquired(&self, keys: &Keys, id: u64, round_at: Instant) {
        let me = std::thread::current().id();
        let mut map = self.map.lock();
        let active = map.len();
        let entry = map
            .get_mut(keys.lock())
            .expect("a contender's entry lives until it leaves");
        entry.contenders -= 1;
        // A thread unseated before that wins again is the holder: its stale guard, told
        // apart by its lock's id, is then released as an unseated holder's (see `release`).
        entry.unseated.retain(|t| *t != me);
        if let Some(old) = entry.holder.filter(|t| *t != me) {
            // Its hold was lost in Redis, and its guard is not dropped yet (see
            // `unseated`).
            entry.unseated.push(old);
        }
        entry.holder = Some(me);
        entry.hold = Some(id);
        entry.seq = 0;
        entry.acquired_at = Instant::now();
        entry.round_at = round_at;
        entry.held_since = entry.acquired_at;
        entry.tell_next(active);
    }

    /// The holder releases: hand the lock to the next local waiter when allowed, or tell
    /// the caller to release it in Redis.
    ///
    /// The fairness budget (`max_handoffs`, `handoff_slice`) applies only while another
    /// process is known to wait — it failed an attempt within the contention window — or
    /// when this process cannot know (its subscription is not confirmed).
    pub fn release<P: Probe>(
        &self,
        remote: &Arc<RemoteLock>,
        lost: bool,
        cfg: &Config,
        subs: &[P],
    ) -> Step {
        let keys = &remote.keys;
        let me = std::thread::current().id();
        let mut map = self.map.lock();
        let active = map.len();
        let Some(entry) = map.get_mut(keys.lock()) else {
            // A stale guard (see below) let go after this thread won the key again and
            // released that hold too: the entry went with it. Only its token is released.
            return Step::Remote {
                forced: None,
                contended: false,
            };
        };
        if entry.holder != Some(me) || entry.hold != Some(remote.id) {
            // Another thread of this process won the key in Redis since (this thread's
            // hold is gone there), or this thread did with a new hold: it holds the entry
            // now, and keeps it. Only this guard's token is released in Redis; nothing is
            // handed on.
            if !entry.unseated.contains(&me) {
                entry.unseated.push(me);
            }
            return Step::Remote {
                forced: None,
                contended: false,
            };
        }
        if !entry.interests.is_empty() {
            // The queue outlives holds: its subscription follows the key (a hot key's
            // queue may never empty).
            entry.follow(keys, subs);
        }
        entry.holder = None;
        let hold = entry.note_hold();
        let window = cfg.contention_window();
        if entry.queue.is_empty() || lost || !cfg.local_handoff {
            entry.releasing = true;
            // Someone else wants it: our next local contender should not barge ahead.
            let contended = !lost
                && (entry.contenders > 0 || entry.others(remote, subs, window) == Others::Waiting);
            return Step::Remote {
                forced: None,
                contended,
            };
        }
        let within_budget =
            entry.seq < cfg.max_handoffs && entry.acquired_at.elapsed() < cfg.handoff_slice;
        let others = if within_budget && entry.seq < MAX_LOCAL_SEQ {
            Others::No // no need to ask
        } else {
            entry.others(remote, subs, window)
        };
        // (`max_handoffs` is at most `MAX_LOCAL_SEQ`: past the token's numbers the budget
        // is spent too, and it is the budget's doing when another process may wait.)
        let forced = if !within_budget && others != Others::No {
            Some(Forced::Budget)
        } else if entry.seq >= MAX_LOCAL_SEQ {
            Some(Forced::Handoffs)
        } else {
            None
        };
        if forced.is_some() {
            entry.releasing = true;
            return Step::Remote {
                forced,
                contended: others == Others::Waiting,
            };
        }
        let slot = entry.queue.pop_front().expect("queue checked non-empty");
        if entry.seq > 0 {
            // This hold began with a handoff too: from grant to grant, it is what the
            // spin choice weighs.
            entry.spin.note(hold);
        }
        entry.seq += 1;
        entry.holder = Some(slot.thread);
        slot.give(Grant::Baton {
            remote: remote.clone(),
            seq: entry.seq,
        });
        entry.held_since = Instant::now();
        entry.tell_next(active);
        Step::HandedOff
    }

    /// The holder (the calling thread) leaves the table but keeps the lock in Redis (a
    /// detached guard releases it there later, without the table): nobody is handed the
    /// lock locally. The next local waiter becomes the process's contender, which waits in
    /// Redis like any other until the detached holder releases.
    pub fn detach(&self, remote: &RemoteLock) {
        let keys = &remote.keys;
        let me = std::thread::current().id();
        let mut map = self.map.lock();
        let Some(entry) = map.get_mut(keys.lock()) else {
            // A stale guard, whose entry went with a later hold (see `release`).
            return;
        };
        if entry.holder != Some(me) || entry.hold != Some(remote.id) {
            // Unseated by another thread's win in Redis, or by this thread's own (see
            // `acquired`): the entry is that hold's now, and the detached guard releases
            // without the table.
            entry.unseated.retain(|t| *t != me);
            if entry.idle() {
                map.remove(keys.lock());
            }
            return;
        }
        entry.holder = None;
        if entry.contenders == 0 && !entry.releasing {
            entry.promote(false);
        }
        if entry.idle() {
            map.remove(keys.lock());
        }
    }

    /// Whether the calling thread holds `keys` through the table (a multi-lock naming it
    /// would wait for its own thread).
    pub fn held_here(&self, keys: &Keys) -> bool {
        let me = std::thread::current().id();
        let map = self.map.lock();
        map.get(keys.lock()).is_some_and(|e| e.holder == Some(me))
    }

    /// The release in Redis is done: the next local waiter (if any) contends, first letting
    /// the remote waiters go when `yield_first`.
    pub fn released(&self, keys: &Keys, yield_first: bool) {
        let mut map = self.map.lock();
        let Some(entry) = map.get_mut(keys.lock()) else {
            return;
        };
        let me = std::thread::current().id();
        if let Some(i) = entry.unseated.iter().position(|t| *t == me) {
            // The release of a holder that was unseated (see `acquired`): the entry's
            // state is the current holder's.
            entry.unseated.swap_remove(i);
            if entry.idle() {
                map.remove(keys.lock());
            }
            return;
        }
        entry.releasing = false;
        if entry.holder.is_none() && entry.contenders == 0 {
            entry.promote(yield_first);
        }
        if entry.idle() {
            map.remove(keys.lock());
        }
    }

    /// A queued waiter leaves without waiting to the end (it is unwinding): takes its slot
    /// out of the queue, and returns the grant that reached it first, if any, for the
    /// caller to pass on.
    pub fn abandon(&self, keys: &Keys, slot: &Slot) -> Option<Grant> {
        let mut map = self.map.lock();
        let grant = slot.take();
        if let Some(entry) = map.get_mut(keys.lock()) {
            entry.queue.retain(|s| !std::ptr::eq(&**s, slot));
            if grant.is_none() && entry.idle() {
                map.remove(keys.lock());
            }
        }
        grant
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::held::Acquisition;

    /// A node listener with fixed answers.
    struct Fake {
        node: NodeId,
        others_waiting: bool,
        confirmed_at: Instant,
    }

    impl Probe for Fake {
        fn node(&self) -> &NodeId {
            &self.node
        }
        fn interest(&self, _: &Keys) -> Box<dyn Send> {
            Box::new(())
        }
        fn heard_mark_within(&self, _: &Keys, _: Duration) -> bool {
            self.others_waiting
        }
        fn hears_marks(&self) -> bool {
            true
        }
        fn confirmed_at(&self, _: &Keys) -> Option<Instant> {
            Some(self.confirmed_at)
        }
    }

    fn probes(others_waiting: bool) -> Vec<Fake> {
        vec![Fake {
            node: NodeId::new("127.0.0.1:1/0"),
            others_waiting,
            // Confirmed before any acquisition: what it heard is complete.
            confirmed_at: Instant::now() - Duration::from_secs(120),
        }]
    }

    fn config(max_handoffs: u32) -> Config {
        crate::api::builder::Builder::new()
            .max_handoffs(max_handoffs)
            .validate()
            .expect("valid settings")
    }

    fn keys() -> Keys {
        Keys::new("t:", b"k").unwrap()
    }

    fn remote(keys: &Keys) -> Arc<RemoteLock> {
        let lease = Duration::from_secs(30);
        Arc::new(RemoteLock::new(
            Acquisition {
                keys: keys.clone(),
                protocol: crate::proto::protocol::Protocols::of(&Config::default()).lock(),
                token: "tok".to_owned(),
                fence: 1,
                previous_lost: false,
                nodes: vec![NodeId::new("127.0.0.1:1/0")],
                started: crate::clock::Stamp::now() - Duration::from_secs(60),
            },
            lease,
            Duration::ZERO,
            None,
            None,
        ))
    }

    /// This thread contends and acquires; returns the remote lock it holds.
    fn hold(table: &Table, keys: &Keys, subs: &[Fake]) -> Arc<RemoteLock> {
        assert!(matches!(
            table.enter(keys, true, true, subs),
            Ok(Role::Contend)
        ));
        let lock = remote(keys);
        table.acquired(keys, lock.id, Instant::now());
        lock
    }

    /// Queues a waiter on another thread; returns its slot once it is queued.
    fn queue_elsewhere(table: &Table, keys: &Keys, subs: &[Fake]) -> Arc<Slot> {
        std::thread::scope(|s| {
            s.spawn(|| match table.enter(keys, true, true, subs) {
                Ok(Role::Queued { slot, .. }) => slot,
                _ => panic!("expected to queue"),
            })
            .join()
            .unwrap()
        })
    }

    /// A new table, its key and one node where nobody else waits; this thread holds the key.
    fn held() -> (Table, Keys, Vec<Fake>, Arc<RemoteLock>) {
        let (table, keys, subs) = (Table::default(), keys(), probes(false));
        let lock = hold(&table, &keys, &subs);
        (table, keys, subs, lock)
    }

    /// As [`held`], with a waiter of another thread queued behind the holder.
    fn held_and_queued() -> (Table, Keys, Vec<Fake>, Arc<RemoteLock>, Arc<Slot>) {
        let (table, keys, subs, lock) = held();
        let slot = queue_elsewhere(&table, &keys, &subs);
        (table, keys, subs, lock, slot)
    }

    #[test]
    fn smoke() {
        let (table, keys, subs, lock) = held();
        let step = table.release(&lock, false, &config(10), &subs);
        assert!(matches!(
            step,
            Step::Remote {
                forced: None,
                contended: false
            }
        ));
        table.released(&keys, false);
        assert!(table.map.lock().is_empty(), "entry removed when idle");
    }

    #[test]
    fn asking_again_for_a_held_lock_is_a_deadlock_error() {
        let (table, keys, subs, _lock) = held();
        assert!(matches!(
            table.enter(&keys, true, true, &subs),
            Err(Error::WouldDeadlock)
        ));
    }

    #[test]
    fn a_try_behind_a_local_holder_would_block() {
        let (table, keys, subs, _lock) = held();
        std::thread::scope(|s| {
            s.spawn(|| {
                assert!(matches!(
                    table.enter(&keys, false, true, &subs),
                    Err(Error::WouldBlock)
                ))
            });
        });
    }

    #[test]
    fn release_hands_the_baton_to_the_queued_waiter() {
        let (table, keys, subs, lock, slot) = held_and_queued();
        assert!(matches!(
            table.release(&lock, false, &config(10), &subs),
            Step::HandedOff
        ));
        match slot.take() {
            Some(Grant::Baton { remote, seq }) => {
                assert_eq!(seq, 1);
                assert!(Arc::ptr_eq(&remote, &lock));
            }
            _ => panic!("expected the baton"),
        }
        assert_eq!(
            table.map.lock()[keys.lock()].holder,
            Some(slot.thread),
            "the waiter holds it now"
        );
    }

    /// The nodes where the entry of `keys` keeps the key subscribed.
    fn interest_nodes(table: &Table, keys: &Keys) -> Vec<NodeId> {
        let map = table.map.lock();
        map[keys.lock()]
            .interests
            .iter()
            .map(|(n, _)| n.clone())
            .collect()
    }

    #[test]
    fn a_queues_subscription_follows_its_key_to_another_node() {
        let (table, keys, old, lock, _slot) = held_and_queued();
        assert_eq!(interest_nodes(&table, &keys), vec![old[0].node.clone()]);
        let new = vec![Fake {
            node: NodeId::new("127.0.0.1:2/0"),
            ..probes(false).remove(0)
        }];
        // The key's route names another node now (a Redis Cluster slot that moved): the
        // release that hands the lock on moves the queue's subscription there.
        assert!(matches!(
            table.release(&lock, false, &config(10), &new),
            Step::HandedOff
        ));
        assert_eq!(interest_nodes(&table, &keys), vec![new[0].node.clone()]);
        // A waiter that queues where the route names yet another node moves it again, and
        // looks for the marks left there before.
        let other = vec![Fake {
            node: NodeId::new("127.0.0.1:3/0"),
            ..probes(false).remove(0)
        }];
        let check_marks = std::thread::scope(|s| {
            s.spawn(|| match table.enter(&keys, true, true, &other) {
                Ok(Role::Queued { check_marks, .. }) => check_marks,
                _ => panic!("expected to queue"),
            })
            .join()
            .unwrap()
        });
        assert!(check_marks, "marks on the new node unchecked");
        assert_eq!(interest_nodes(&table, &keys), vec![other[0].node.clone()]);
    }

    #[test]
    fn a_lost_lock_is_not_handed_on() {
        let (table, keys, subs, lock, slot) = held_and_queued();
        assert!(matches!(
            table.release(&lock, true, &config(10), &subs),
            Step::Remote { .. }
        ));
        // After the release in Redis, the waiter contends for the process.
        table.released(&keys, false);
        assert!(matches!(
            slot.take(),
            Some(Grant::Contend { yield_first: false })
        ));
    }

    #[test]
    fn a_waiter_timing_out_leaves_the_queue() {
        let (table, keys, subs, lock, slot) = held_and_queued();
        let past = Some(Instant::now() - Duration::from_millis(1));
        assert!(matches!(
            table.wait_queued(&keys, &slot, past, None),
            Err(Error::Timeout)
        ));
        // Nobody to hand it to: the release goes to Redis.
        assert!(matches!(
            table.release(&lock, false, &config(10), &subs),
            Step::Remote { forced: None, .. }
        ));
    }

    #[test]
    fn a_grant_that_races_the_timeout_is_taken_not_lost() {
        let (table, keys, subs, lock, slot) = held_and_queued();
        assert!(matches!(
            table.release(&lock, false, &config(10), &subs),
            Step::HandedOff
        ));
        // The deadline has passed too, but the grant came first: the waiter holds it.
        let past = Some(Instant::now() - Duration::from_millis(1));
        assert!(matches!(
            table.wait_queued(&keys, &slot, past, None),
            Ok(Grant::Baton { seq: 1, .. })
        ));
    }

    #[test]
    fn the_budget_applies_only_while_another_process_waits() {
        let keys = keys();
        for (others_waiting, expect_forced) in [(false, false), (true, true)] {
            let (table, subs) = (Table::default(), probes(others_waiting));
            let lock = hold(&table, &keys, &subs);
            let cfg = config(1);
            // First handoff: within the budget of one.
            queue_elsewhere(&table, &keys, &subs);
            assert!(matches!(
                table.release(&lock, false, &cfg, &subs),
                Step::HandedOff
            ));
            // Pretend the waiter is this thread now, and a next one queues.
            table.map.lock().get_mut(keys.lock()).unwrap().holder =
                Some(std::thread::current().id());
            queue_elsewhere(&table, &keys, &subs);
            let step = table.release(&lock, false, &cfg, &subs);
            match step {
                Step::Remote { forced, contended } => {
                    assert!(expect_forced, "budget spent while others wait");
                    assert_eq!(forced, Some(Forced::Budget));
                    assert!(contended);
                }
                Step::HandedOff => assert!(!expect_forced, "alone: keeps the baton"),
            }
        }
    }

    #[test]
    fn a_process_alone_goes_back_to_redis_when_the_handoff_numbers_run_out() {
        let (table, keys, subs, lock, _slot) = held_and_queued();
        // Nobody else waits: the budget does not apply, but the token's handoff numbers
        // are all used.
        table.map.lock().get_mut(keys.lock()).unwrap().seq = MAX_LOCAL_SEQ;
        assert!(matches!(
            table.release(&lock, false, &config(MAX_LOCAL_SEQ), &subs),
            Step::Remote {
                forced: Some(Forced::Handoffs),
                contended: false
            }
        ));
    }

    #[test]
    fn a_detached_holder_hands_nothing_on_and_the_next_waiter_contends() {
        let (table, keys, subs, lock, slot) = held_and_queued();
        table.detach(&lock);
        assert!(matches!(
            slot.take(),
            Some(Grant::Contend { yield_first: false })
        ));
        let map = table.map.lock();
        let entry = &map[keys.lock()];
        assert_eq!(entry.holder, None);
        assert_eq!(entry.contenders, 1);
        drop(map);
        // The holder's thread may ask again: it is no longer the holder.
        assert!(matches!(
            table.enter(&keys, false, true, &subs),
            Err(Error::WouldBlock)
        ));
    }

    #[test]
    fn a_detached_holder_alone_leaves_no_entry() {
        let (table, _keys, _subs, lock) = held();
        table.detach(&lock);
        assert!(table.map.lock().is_empty(), "entry removed when idle");
    }

    #[test]
    fn a_contender_that_gives_up_passes_the_duty_on() {
        let (table, keys, subs) = (Table::default(), keys(), probes(false));
        assert!(matches!(
            table.enter(&keys, true, true, &subs),
            Ok(Role::Contend)
        ));
        let slot = queue_elsewhere(&table, &keys, &subs);
        table.contend_failed(&keys);
        assert!(matches!(
            slot.take(),
            Some(Grant::Contend { yield_first: false })
        ));
    }

    #[test]
    fn an_unseated_holder_leaves_the_new_holder_its_entry_in_either_order() {
        let cfg = crate::api::builder::Builder::new()
            .local_handoff(false)
            .validate()
            .expect("valid settings");
        for new_first in [false, true] {
            let (table, keys, subs, old) = held();
            let release = |lock: &Arc<RemoteLock>| {
                assert!(matches!(
                    table.release(lock, true, &cfg, &subs),
                    Step::Remote { forced: None, .. }
                ));
                table.released(&keys, false);
            };
            let new_holder = std::thread::scope(|s| {
                s.spawn(|| {
                    // Without the handoff this thread contends beside the holder, and wins
                    // once the holder's key is gone.
                    assert!(matches!(
                        table.enter(&keys, true, false, &subs),
                        Ok(Role::Contend)
                    ));
                    let new = remote(&keys);
                    table.acquired(&keys, new.id, Instant::now());
                    if new_first {
                        release(&new);
                    }
                    std::thread::current().id()
                })
                .join()
                .unwrap()
            });
            release(&old);
            if new_first {
                assert!(table.map.lock().is_empty(), "entry removed when idle");
            } else {
                let map = table.map.lock();
                let entry = &map[keys.lock()];
                assert_eq!(entry.holder, Some(new_holder), "still the new holder's");
                assert!(!entry.releasing && entry.unseated.is_empty());
            }
        }
    }
}
