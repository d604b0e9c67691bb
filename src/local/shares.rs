//! Whose turn it is on a read-write lock inside one process.
//!
//! A process holds at most one remote hold per read-write lock, a *read* hold or the
//! *write* hold, and lets its own threads use it:
//!
//! * under a remote **read** hold, local readers share it;
//! * under the remote **write** hold, local writers take turns (one at a time, like the
//!   plain lock's baton), and local readers may read between them: the process owns the
//!   name alone, so its own readers exclude only its own writers. But a write hold granted
//!   while another process may wait (Redis says so with the grant) serves the local
//!   writers only, and goes back when none waits: the local readers then read in the next
//!   read phase, side by side with the other processes' readers, instead of one process's
//!   readers at a time.
//!
//! Local writers are preferred: while one waits, a read hold admits at most
//! [`max_handoffs`](crate::Builder::max_handoffs) more local readers (the rest of the
//! process's read phase: giving the hold back at once would leave the threads that still
//! read idle, and cost a Redis round trip per writer), then none; it goes back when its
//! readers are done, so the writer can ask Redis for the write hold. Under the write hold
//! a waiting local writer goes before new local readers. A remote hold serves local turns
//! for at most [`handoff_slice`](crate::Builder::handoff_slice) and `max_handoffs` local
//! writes (its *budget*; reads run side by side, so the slice alone bounds them); after
//! that the process asks Redis whether another process waits (one cheap command): a
//! writer, for a read hold; anyone, for the write hold. If none does, a new budget begins
//! (and a write hold serves local readers again); else nobody new is admitted and the last
//! local user gives the hold back. A read hold also drains as soon as the process hears
//! that another process's writer began to wait (its failed attempt says so on the name's
//! channel, which the process keeps subscribed while the turn lives): the readers of every
//! process then finish together and the writer gets in, instead of waiting for each
//! process's next budget check; the check still catches a mark that was not heard.
//!
//! An upgradable read is not shared: it is a remote hold of the thread's own, beside the
//! process's turns (it excludes the other upgradable reads, so no two threads could share
//! it anyway), and so is the write hold it upgrades to, and the read hold that one
//! downgrades to. A thread's own hold goes back in Redis when the thread lets go of it,
//! as every hold does without local handoff. The process's read hold and a thread's
//! upgradable hold are two read holds in Redis; an upgrade waits for the process's read
//! hold to drain like any other process's (Redis tells the process at its next budget
//! check that a writer waits). A downgrade of the process's write hold keeps it in the
//! turns, as the process's read hold: the local readers waiting may join it at once.
//!
//! This module only decides ([`Turn::next`], [`Turn::leave`]); the engine talks to Redis.
//! One thread at a time contends or gives the hold back for a name ([`Turn::busy`]), and
//! one at a time asks for a new budget while the others go on; the others wait for
//! what it brings back.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::fencing::MAX_LOCAL_SEQ;
use crate::local::held::RemoteLock;
use crate::local::table::Probe;
use crate::proto::keys::Keys;

/// The read-write locks of one process and who holds what.
#[derive(Default)]
pub(crate) struct ReadShares {
    pub state: Mutex<SharesState>,
    /// Notified whenever a turn changes: a holder left, a remote hold came or went.
    pub changed: Condvar,
}

#[derive(Default)]
pub(crate) struct SharesState {
    /// Per name: this process's turn state. An entry exists while a local thread holds
    /// or waits for the name.
    pub turns: HashMap<Keys, Turn>,
    /// What each thread holds, per name: a thread never waits for itself.
    pub threads: HashMap<(Keys, ThreadId), Mine>,
    /// Semaphores for which a local thread waits for a permit in Redis.
    pub permit_contenders: HashSet<Keys>,
}

pub(crate) enum Mine {
    /// This many read guards of the thread, sharing this remote hold and token.
    Read(Arc<RemoteLock>, u64, usize),
    Write,
    /// An upgradable read hold of the thread's own.
    Upgradable,
}

/// Which remote hold a process has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Read,
    Write,
}

/// What a local thread that wants the name should do now.
pub(crate) enum Next {
    /// Use the process's remote hold (already counted as a holder).
    Admit,
    /// Ask Redis for a hold of its own kind (the turn is now busy with it).
    Contend,
    /// The hold's budget is spent: ask Redis whether another process waits, then report
    /// with [`Turn::checked`]. Meanwhile other threads keep taking turns on the hold.
    Check,
    /// Wait for the turn to change.
    Wait,
    /// Give this remote hold back in Redis first (nobody uses it and it must go; the turn
    /// is busy until [`Turn::released`]), then look again.
    GiveBack(Arc<RemoteLock>),
}

/// One name's turn state in one process.
#[derive(Default)]
pub(crate) struct Turn {
    pub remote: Option<(Arc<RemoteLock>, Mode)>,
    /// When the current budget began, and local writes since.
    since: Option<Instant>,
    uses: u32,
    pub readers: usize,
    pub writing: bool,
    /// Writes served by the current remote hold (the last one's local sequence number).
    pub writes: u32,
    /// Local threads waiting for a turn (readers, writers).
    pub waiting_readers: usize,
    pub waiting_writers: usize,
    /// A local thread talks to Redis for this name (contends or gives the hold back).
    pub busy: bool,
    /// A local thread asks Redis whether the budget may be renewed.
    checking: bool,
    /// No new holder on the current remote hold: the last one out gives it back.
    pub draining: bool,
    /// The write hold was granted while another process may have waited: it serves this
    /// process's writers only, and goes back when none waits, so that the local readers
    /// read in the next read phase, side by side with other processes' readers.
    writers_only: bool,
    /// Under a read hold, once a local writer waits: how many more local readers it admits
    /// (the rest of this process's read phase) before it drains for the writer.
    reads_left: Option<u32>,
    /// Keeps the name's channel subscribed while the turn lives, and the listeners to ask
    /// whether a remote writer's mark was heard (see [`Turn::next`]): one per node of the
    /// name's route, found once.
    pub listening: Vec<(Box<dyn Send>, Box<dyn Probe + Send>)>,
}

/// The budget of one remote hold.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budget {
    pub slice: Duration,
    pub uses: u32,
}

impl Turn {
    /// What a thread that wants the name (to write if `write`) should do; admits it when
    /// it may use the remote hold, and marks the turn busy when it must talk to Redis.
    /// The caller counts itself among the waiting threads while it asks.
    /// `writer_heard`: another process's writer marked itself waiting since the read hold
    /// was taken (heard on the channel): the hold drains at once, as at a budget check
    /// that found it.
    pub fn next(&mut self, write: bool, budget: Budget, lost: bool, writer_heard: bool) -> Next {
        if self.busy {
            return Next::Wait;
        }
        let Some((_, mode)) = &self.remote else {
            // A reader lets a waiting local writer ask first.
            if !write && self.waiting_writers > 0 {
                return Next::Wait;
            }
            self.busy = true;
            return Next::Contend;
        };
        let mode = *mode;
        if mode == Mode::Read && self.waiting_writers > 0 {
            if *self.reads_left.get_or_insert(budget.uses) == 0 {
                self.draining = true;
            }
        } else {
            self.reads_left = None;
        }
        if lost || (mode == Mode::Read && writer_heard) {
            self.draining = true;
        }
        let blocked = self.draining
            || self.writing
            || (write && (mode == Mode::Read || self.readers > 0))
            || (!write && mode == Mode::Write && (self.waiting_writers > 0 || self.writers_only));
        if blocked {
            return self.wait_or_give_back();
        }
        // The local sequence numbers of one remote hold's writes must fit a token's low
        // bits: a hold that served that many goes back, whatever the budget.
        if self.writes >= MAX_LOCAL_SEQ - 1 {
            self.draining = true;
            return self.wait_or_give_back();
        }
        let fresh =
            self.since.is_some_and(|s| s.elapsed() < budget.slice) && self.uses < budget.uses;
        if !fresh && !self.checking {
            self.checking = true;
            return Next::Check;
        }
        self.admit(write);
        Next::Admit
    }

    /// The count of local threads waiting for a turn among which a thread that wants the
    /// name (to write if `write`) counts itself while it asks.
    pub fn waiting(&mut self, write: bool) -> &mut usize {
        match write {
            true => &mut self.waiting_writers,
            false => &mut self.waiting_readers,
        }
    }

    fn wait_or_give_back(&mut self) -> Next {
        match self.give_back_if_idle() {
            Some(remote) => Next::GiveBack(remote),
            None => Next::Wait,
        }
    }

    fn admit(&mut self, write: bool) {
        if write {
            // Only exclusive turns count against `max_handoffs`: readers run side by
            // side, so the time slice alone bounds them.
            self.uses += 1;
            self.writing = true;
            self.writes += 1;
        } else {
            self.readers += 1;
            if let Some(left) = &mut self.reads_left {
                *left = left.saturating_sub(1);
            }
        }
    }

    /// A contender came back with a remote hold of `mode`: it is the first holder.
    /// `others_wait`: another process may have waited when the write hold was granted.
    pub fn acquired(&mut self, remote: Arc<RemoteLock>, mode: Mode, others_wait: bool) {
        self.remote = Some((remote, mode));
        self.busy = false;
        self.draining = false;
        self.writers_only = mode == Mode::Write && others_wait;
        self.reads_left = None;
        self.writes = 0;
        self.renew_budget();
        self.admit(mode == Mode::Write);
    }

    /// The budget check came back: a new budget if nobody else waits (`keep`), else the
    /// hold drains.
    pub fn checked(&mut self, keep: bool) {
        self.checking = false;
        if keep {
            // Nobody else waits: the write hold may serve local readers again.
            self.writers_only = false;
            self.renew_budget();
        } else {
            self.draining = true;
        }
    }

    fn renew_budget(&mut self) {
        self.since = Some(Instant::now());
        self.uses = 0;
    }

    /// A local holder leaves. Returns the remote hold when it must now be given back
    /// (the turn is then busy until [`Turn::released`]).
    pub fn leave(&mut self, write: bool) -> Option<Arc<RemoteLock>> {
        if write {
            self.writing = false;
        } else {
            self.readers = self.readers.saturating_sub(1);
        }
        self.give_back_if_idle()
    }

    /// Gives the remote hold back when nobody uses it and it must go: it drains, a local
    /// writer waits behind a read hold whose read phase is over (no local reader waits, or
    /// none may come), no local writer waits for a write hold that serves writers only, or
    /// no local thread waits for it. A remote hold never stays with no local user and
    /// nobody waiting: it would block other processes.
    pub fn give_back_if_idle(&mut self) -> Option<Arc<RemoteLock>> {
        if self.busy || self.readers > 0 || self.writing {
            return None;
        }
        let idle = self.waiting_readers == 0 && self.waiting_writers == 0;
        let (_, mode) = self.remote.as_ref()?;
        let writer_behind_reads = *mode == Mode::Read
            && self.waiting_writers > 0
            && (self.waiting_readers == 0 || self.reads_left == Some(0));
        let writes_done = *mode == Mode::Write && self.writers_only && self.waiting_writers == 0;
        if !(idle || self.draining || writer_behind_reads || writes_done) {
            return None;
        }
        self.busy = true;
        self.draining = false;
        self.remote.take().map(|(r, _)| r)
    }

    /// The local writer keeps the write hold for itself, out of the turns (a detached
    /// guard gives it back in Redis later): nobody else is admitted to it, and the next
    /// local thread that wants the name asks Redis, where it waits like any other process
    /// until the detached guard lets go.
    pub fn detach(&mut self) {
        debug_assert!(self.writing, "only the writer detaches");
        self.writing = false;
        self.remote = None;
        self.draining = false;
        self.writers_only = false;
        self.reads_left = None;
    }

    /// The local writer turned the write hold into `remote`, a read hold of the same token,
    /// and reads on it: the process's read hold now, which the local readers may join (its
    /// budget goes on).
    pub fn downgraded(&mut self, remote: Arc<RemoteLock>) {
        debug_assert!(self.writing, "only the writer downgrades");
        self.remote = Some((remote, Mode::Read));
        self.writing = false;
        self.writers_only = false;
        self.reads_left = None;
        self.admit(false);
    }

    /// Whether `remote` is the process's hold of the name, on which its threads take turns
    /// (not a thread's own hold: see the module's docs).
    pub fn holds(&self, remote: &Arc<RemoteLock>) -> bool {
        self.remote
            .as_ref()
            .is_some_and(|(r, _)| Arc::ptr_eq(r, remote))
    }

    /// The remote hold is given back (or the attempt, the check ended): others may go.
    pub fn released(&mut self) {
        self.busy = false;
    }

    /// Nobody holds or waits: the entry can go.
    pub fn unused(&self) -> bool {
        self.remote.is_none()
            && !self.busy
            && self.readers == 0
            && !self.writing
            && self.waiting_readers == 0
            && self.waiting_writers == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUDGET: Budget = Budget {
        slice: Duration::from_secs(60),
        uses: 3,
    };

    fn hold() -> Arc<RemoteLock> {
        let acquisition = crate::local::held::Acquisition {
            keys: Keys::new("t:", b"n").unwrap(),
            protocol: crate::proto::protocol::Protocols::of(&Default::default())
                .get(crate::proto::protocol::Kind::Read)
                .unwrap(),
            token: "r1".to_owned(),
            fence: 1,
            previous_lost: false,
            nodes: Vec::new(),
            started: crate::clock::Stamp::now(),
        };
        let lease = Duration::from_secs(30);
        Arc::new(RemoteLock::new(
            acquisition,
            lease,
            Duration::ZERO,
            None,
            None,
        ))
    }

    impl PartialEq for Next {
        fn eq(&self, other: &Next) -> bool {
            std::mem::discriminant(self) == std::mem::discriminant(other)
        }
    }

    impl std::fmt::Debug for Next {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(match self {
                Next::Admit => "Admit",
                Next::Contend => "Contend",
                Next::Check => "Check",
                Next::Wait => "Wait",
                Next::GiveBack(_) => "GiveBack",
            })
        }
    }

    fn waiting(readers: usize, writers: usize) -> Turn {
        Turn {
            waiting_readers: readers,
            waiting_writers: writers,
            ..Turn::default()
        }
    }

    fn give_back() -> Next {
        Next::GiveBack(hold())
    }

    #[test]
    fn smoke() {
        let mut t = waiting(2, 0);
        assert_eq!(t.next(false, BUDGET, false, false), Next::Contend);
        assert_eq!(
            t.next(false, BUDGET, false, false),
            Next::Wait,
            "one contender"
        );
        t.acquired(hold(), Mode::Read, false);
        assert_eq!(t.next(false, BUDGET, false, false), Next::Admit);
        assert_eq!(t.readers, 2);
        t.waiting_readers = 0;
        assert!(t.leave(false).is_none());
        assert!(t.leave(false).is_some(), "the last one out, nobody waiting");
        t.released();
        assert!(t.unused());
    }

    #[test]
    fn a_waiting_writer_ends_the_local_read_phase() {
        let mut t = Turn::default();
        t.next(false, BUDGET, false, false);
        t.acquired(hold(), Mode::Read, false);
        t.waiting_writers = 1;
        t.waiting_readers = 1;
        assert_eq!(t.next(true, BUDGET, false, false), Next::Wait);
        for _ in 0..BUDGET.uses {
            assert_eq!(
                t.next(false, BUDGET, false, false),
                Next::Admit,
                "the read phase goes on for a budget of reads"
            );
        }
        assert_eq!(
            t.next(false, BUDGET, false, false),
            Next::Wait,
            "then readers stop"
        );
        for _ in 0..BUDGET.uses {
            assert!(t.leave(false).is_none(), "readers are still reading");
        }
        let back = t.leave(false);
        assert!(back.is_some(), "the last reader gives the read hold back");
        assert_eq!(
            t.next(true, BUDGET, false, false),
            Next::Wait,
            "while it is given back"
        );
        t.released();
        assert_eq!(
            t.next(false, BUDGET, false, false),
            Next::Wait,
            "the writer asks first"
        );
        assert_eq!(t.next(true, BUDGET, false, false), Next::Contend);
        t.waiting_writers = 0;
        t.acquired(hold(), Mode::Write, false);
        assert!(t.writing);
        assert_eq!(t.writes, 1);
    }

    #[test]
    fn a_read_hold_with_no_local_reader_left_goes_back_to_the_writer() {
        let mut t = Turn::default();
        t.next(false, BUDGET, false, false);
        t.acquired(hold(), Mode::Read, false);
        t.waiting_writers = 1;
        assert!(
            t.leave(false).is_some(),
            "no reader waits: the read phase is over"
        );
    }

    #[test]
    fn a_write_hold_others_wait_for_serves_writers_only() {
        let mut t = waiting(1, 1);
        t.next(true, BUDGET, false, false);
        t.acquired(hold(), Mode::Write, true);
        t.waiting_writers = 1;
        assert!(t.leave(true).is_none(), "a local writer still waits");
        assert_eq!(
            t.next(false, BUDGET, false, false),
            Next::Wait,
            "no local reads"
        );
        assert_eq!(t.next(true, BUDGET, false, false), Next::Admit);
        t.waiting_writers = 0;
        assert!(
            t.leave(true).is_some(),
            "no writer left: the hold goes back though a reader waits"
        );
        t.released();
        assert_eq!(t.next(false, BUDGET, false, false), Next::Contend);
    }

    #[test]
    fn a_write_hold_nobody_else_waits_for_serves_readers_again() {
        let mut t = waiting(1, 1);
        t.next(true, BUDGET, false, false);
        t.acquired(hold(), Mode::Write, true);
        t.checked(true);
        t.waiting_writers = 0;
        assert!(t.leave(true).is_none(), "kept for the local reader");
        assert_eq!(t.next(false, BUDGET, false, false), Next::Admit);
    }

    #[test]
    fn write_hold_serves_local_readers_and_writers_in_turn() {
        let mut t = waiting(1, 1);
        t.next(true, BUDGET, false, false);
        t.acquired(hold(), Mode::Write, false);
        t.waiting_writers = 0;
        assert_eq!(
            t.next(false, BUDGET, false, false),
            Next::Wait,
            "the writer writes"
        );
        assert!(t.leave(true).is_none(), "kept for the waiting threads");
        assert_eq!(t.next(false, BUDGET, false, false), Next::Admit);
        assert_eq!(
            t.next(true, BUDGET, false, false),
            Next::Wait,
            "a reader reads"
        );
        t.leave(false);
        assert_eq!(t.next(true, BUDGET, false, false), Next::Admit);
        t.leave(true);
        assert_eq!(t.next(true, BUDGET, false, false), Next::Admit);
        assert_eq!(t.writes, 3);
        t.leave(true);
        // Three writes (reads do not count): the budget is spent; Redis says another
        // process waits.
        assert_eq!(t.next(false, BUDGET, false, false), Next::Check);
        t.checked(false);
        assert_eq!(t.next(false, BUDGET, false, false), give_back());
    }

    #[test]
    fn read_budget_is_time_and_asks_redis_once() {
        let mut t = waiting(1, 0);
        t.next(false, BUDGET, false, false);
        t.acquired(hold(), Mode::Read, false);
        for _ in 0..10 {
            assert_eq!(
                t.next(false, BUDGET, false, false),
                Next::Admit,
                "reads do not count"
            );
        }
        let spent = Budget {
            slice: Duration::ZERO,
            ..BUDGET
        };
        assert_eq!(t.next(false, spent, false, false), Next::Check);
        assert_eq!(
            t.next(false, spent, false, false),
            Next::Admit,
            "one check at a time, and turns go on meanwhile"
        );
        t.checked(true);
        assert_eq!(t.next(false, BUDGET, false, false), Next::Admit);
    }

    #[test]
    fn a_hold_goes_back_before_its_write_numbers_run_out() {
        let mut t = waiting(0, 1);
        t.next(true, BUDGET, false, false);
        t.acquired(hold(), Mode::Write, false);
        assert!(t.leave(true).is_none(), "a writer still waits");
        t.writes = MAX_LOCAL_SEQ - 1;
        assert_eq!(t.next(true, BUDGET, false, false), give_back());
    }

    /// A turn whose local writer writes on the remote write hold, `readers` local readers
    /// waiting.
    fn writing(readers: usize) -> Turn {
        let mut t = waiting(readers, 0);
        t.next(true, BUDGET, false, false);
        t.acquired(hold(), Mode::Write, false);
        assert_eq!(
            t.next(false, BUDGET, false, false),
            Next::Wait,
            "the writer writes"
        );
        t
    }

    #[test]
    fn a_detached_write_hold_sends_the_waiters_to_redis() {
        let mut t = writing(1);
        t.detach();
        assert_eq!(
            t.next(false, BUDGET, false, false),
            Next::Contend,
            "no local turn on the detached hold: the reader asks Redis"
        );
        t.waiting_readers = 0;
        t.released();
        assert!(t.unused());
    }

    #[test]
    fn a_downgraded_write_hold_admits_the_local_readers() {
        let mut t = writing(2);
        let read = hold();
        t.downgraded(read.clone());
        assert!(t.holds(&read));
        assert_eq!(t.readers, 1, "the writer reads now");
        assert_eq!(
            t.next(false, BUDGET, false, false),
            Next::Admit,
            "a reader joins"
        );
        assert_eq!(
            t.next(true, BUDGET, false, false),
            Next::Wait,
            "a writer waits"
        );
        t.waiting_readers = 0;
        assert!(t.leave(false).is_none());
        assert!(t.leave(false).is_some(), "the last reader gives it back");
    }

    #[test]
    fn lost_hold_admits_nobody() {
        let mut t = waiting(1, 0);
        t.next(false, BUDGET, false, false);
        t.acquired(hold(), Mode::Read, false);
        assert_eq!(t.next(false, BUDGET, true, false), Next::Wait);
        assert!(
            t.leave(false).is_some(),
            "the last reader gives the lost hold back"
        );
    }
}
