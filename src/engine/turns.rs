//! Read-write locks inside one process: a thread's turn on the process's remote read or
//! write hold (the rules are in `local::shares`), asking Redis for a hold when the turn
//! says so, checking the budget, and giving the hold back when its last user leaves; and a
//! thread's own holds beside the turns: an upgradable read, its upgrade to the write hold,
//! and the downgrade of a write hold to a read hold.
//!
//! A thread that talks to Redis for the process's turn (contends, checks the budget, gives
//! the hold back) does so with the state's mutex unlocked, under an `OnUnwind` guard: if it
//! panics, the turn is put right on the way out (not busy, the thread no longer counted as
//! waiting, a hold nobody uses given back in the background), so that a panic never
//! strands the name for the process's other threads.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::ThreadId;
use std::time::Instant;

use parking_lot::MutexGuard;

use crate::clock::Stamp;
use crate::engine::contest::{Paused, Start, Wait};
use crate::engine::shared_hold::Hold;
use crate::engine::state::Engine;
use crate::error::{Error, LostReason, Result, Unlocked};
use crate::fencing::{self, MAX_LOCAL_SEQ};
use crate::local::held::{Acquisition, Changed, RemoteLock};
use crate::local::shares::{Budget, Mine, Mode, Next, SharesState, Turn};
use crate::local::table::Probe;
use crate::local::undo::OnUnwind;
use crate::proto::keys::Keys;
use crate::proto::node::may_have_run;
use crate::proto::protocol::Kind;
use crate::proto::rw_scripts::Want;
use crate::stats::{Counters, HoldKind, Path};

static NEXT_SHARER: AtomicU64 = AtomicU64::new(1);

impl Engine {
    /// Takes a read hold of `name`: the process's remote hold when the turn rules admit
    /// this thread, else one asked of Redis for the process.
    pub(crate) fn read(self: &Arc<Self>, name: &[u8], wait: Wait<'_>) -> Result<Hold> {
        self.timed(HoldKind::Read, wait, || {
            self.take_turn(name, Mode::Read, wait)
        })
    }

    /// Takes the write hold of `name` (or a turn on this process's write hold).
    pub(crate) fn write(self: &Arc<Self>, name: &[u8], wait: Wait<'_>) -> Result<Hold> {
        self.timed(HoldKind::Write, wait, || {
            self.take_turn(name, Mode::Write, wait)
        })
    }

    fn take_turn(self: &Arc<Self>, name: &[u8], mode: Mode, wait: Wait<'_>) -> Result<Hold> {
        let keys = Keys::new(&self.cfg.key_prefix, name)?;
        let me = std::thread::current().id();
        let mut st = self.shares.state.lock();
        match st.threads.get_mut(&(keys.clone(), me)) {
            // An upgradable read: a read could wait behind a writer who waits for it.
            Some(Mine::Write | Mine::Upgradable) => return Err(Error::WouldDeadlock),
            Some(Mine::Read(..)) if mode == Mode::Write => return Err(Error::WouldDeadlock),
            // A thread that reads already joins its own hold: asking again could wait
            // behind a writer who waits for this thread. Not a hold known lost: the thread
            // is told, rather than given a guard of a hold it no longer has.
            Some(Mine::Read(remote, token, n)) => {
                if let Some(reason) = remote.lost(&self.counters) {
                    return Err(Error::Lost(reason));
                }
                *n += 1;
                let (remote, token) = (remote.clone(), *token);
                if let Some(turn) = st.turns.get_mut(&keys).filter(|t| t.holds(&remote)) {
                    turn.readers += 1;
                }
                Counters::inc(&self.counters.local_handoffs);
                return Ok(self.sharer(remote, token, Path::Handoff));
            }
            None => {}
        }
        if !self.cfg.local_handoff {
            drop(st);
            let (remote, _) = self.acquire_shared(&keys, want(mode), wait)?;
            let token = turn_token(&remote, mode, u32::from(mode == Mode::Write));
            self.shares
                .state
                .lock()
                .threads
                .insert((keys, me), mine(mode, &remote, token));
            return Ok(self.sharer(remote, token, Path::Remote));
        }
        let write = mode == Mode::Write;
        *st.turns.entry(keys.clone()).or_default().waiting(write) += 1;
        // A panic in the loop is put right where it can happen (see `unlocked_for`).
        let taken = self.turn_loop(&mut st, &keys, mode, wait);
        stop_waiting(st.turns.entry(keys.clone()).or_default(), write);
        if let Ok((remote, token, _)) = &taken {
            st.threads
                .insert((keys.clone(), me), mine(mode, remote, *token));
        }
        let mut back = st.turns.get_mut(&keys).and_then(|t| t.give_back_if_idle());
        // The last thread that waited for the hold gives it back as its own wait allows.
        if let Some(remote) = back.take_if(|_| wait.bounded()) {
            let undo = |t: &mut Turn| t.released();
            self.unlocked_for(&mut st, &keys, undo, || self.give_back_for(&remote, wait));
            if let Some(turn) = st.turns.get_mut(&keys) {
                turn.released();
            }
        }
        self.settle(st, &keys, back);
        taken.map(|(remote, token, path)| self.sharer(remote, token, path))
    }

    /// Asks the turn what to do until this thread is admitted (or contends and wins), the
    /// wait policy says stop, or an error. With the hold: how this thread got it.
    fn turn_loop(
        self: &Arc<Self>,
        st: &mut MutexGuard<'_, SharesState>,
        keys: &Keys,
        mode: Mode,
        wait: Wait<'_>,
    ) -> Result<(Arc<RemoteLock>, u64, Path)> {
        let write = mode == Mode::Write;
        let budget = Budget {
            slice: self.cfg.handoff_slice,
            uses: self.cfg.max_handoffs,
        };
        // Why this thread's budget check failed, if it did: a caller that does not wait is
        // told that, not that the name is held (nobody answered).
        let mut unchecked: Option<Error> = None;
        loop {
            let turn = st.turns.entry(keys.clone()).or_default();
            let lost = turn
                .remote
                .as_ref()
                .is_some_and(|(r, _)| r.lost(&self.counters).is_some());
            // A read hold that other local threads share, or wait for, keeps the name's
            // channel subscribed, to hear another process's writer begin to wait (a hold
            // with one user goes back when it is done anyway).
            let company = turn.readers + turn.waiting_readers + turn.waiting_writers > 1;
            let reading = matches!(turn.remote, Some((_, Mode::Read)));
            if reading && company && turn.listening.is_empty() {
                turn.listening = self.listen(keys);
            }
            let heard = match &turn.remote {
                Some((r, Mode::Read)) if !turn.draining => {
                    let since = r.acquired_at.elapsed();
                    (turn.listening.iter()).any(|(_, p)| p.heard_mark_within(keys, since))
                }
                _ => false,
            };
            match turn.next(write, budget, lost, heard) {
                Next::Admit => {
                    let (remote, held) = turn.remote.as_ref().expect("admitted to a hold");
                    let token = turn_token(remote, *held, turn.writes);
                    Counters::inc(&self.counters.local_handoffs);
                    return Ok((remote.clone(), token, Path::Handoff));
                }
                Next::Contend => {
                    let undo = |t: &mut Turn| {
                        t.released();
                        stop_waiting(t, write);
                    };
                    let got = self.unlocked_for(st, keys, undo, || {
                        self.acquire_shared(keys, want(mode), wait)
                    });
                    let turn = st.turns.entry(keys.clone()).or_default();
                    self.shares.changed.notify_all();
                    return match got {
                        Ok((remote, others_wait)) => {
                            turn.acquired(remote.clone(), mode, others_wait);
                            let token = turn_token(&remote, mode, turn.writes);
                            Ok((remote, token, Path::Remote))
                        }
                        Err(e) => {
                            turn.released();
                            Err(e)
                        }
                    };
                }
                Next::Check => {
                    let remote = turn.remote.clone();
                    // As a check that failed: the hold drains.
                    let undo = |t: &mut Turn| {
                        t.checked(false);
                        stop_waiting(t, write);
                    };
                    let keep = remote.map_or(Ok(false), |(r, _)| {
                        let deadline = wait.deadline();
                        self.unlocked_for(st, keys, undo, || self.keep_turns(&r, deadline))
                    });
                    let keep = keep.unwrap_or_else(|e| {
                        log::debug!("checking for waiting writers failed: {e}");
                        unchecked = Some(e);
                        false
                    });
                    st.turns.entry(keys.clone()).or_default().checked(keep);
                    self.shares.changed.notify_all();
                }
                Next::GiveBack(remote) => {
                    let undo = |t: &mut Turn| {
                        self.release_in_background(&remote);
                        t.released();
                        stop_waiting(t, write);
                    };
                    self.unlocked_for(st, keys, undo, || self.give_back_for(&remote, wait));
                    st.turns.entry(keys.clone()).or_default().released();
                    self.shares.changed.notify_all();
                }
                Next::Wait => match wait {
                    Wait::No => return Err(unchecked.take().unwrap_or(Error::WouldBlock)),
                    Wait::Until(..) => self.await_change(st, wait)?,
                },
            }
        }
    }

    /// Runs `call`, a Redis call for the turn of `keys`, with the state's mutex unlocked.
    /// Should it panic, the turn is put right on the way out, so that the name stays
    /// usable by the process: `undo` does what the call's outcome was to do (and takes the
    /// calling thread out of the waiting threads, if it counts among them), a hold that
    /// nobody uses or waits for any more is given back in the background, and the other
    /// local threads look again.
    fn unlocked_for<T>(
        &self,
        st: &mut MutexGuard<'_, SharesState>,
        keys: &Keys,
        undo: impl FnOnce(&mut Turn),
        call: impl FnOnce() -> T,
    ) -> T {
        // Run inside the unlocked section: the state's mutex is free while it unwinds.
        MutexGuard::unlocked(st, || {
            let unwinding = OnUnwind::new(|| {
                let mut st = self.shares.state.lock();
                if let Some(turn) = st.turns.get_mut(keys) {
                    undo(turn);
                    if let Some(remote) = turn.give_back_if_idle() {
                        self.release_in_background(&remote);
                        turn.released();
                    }
                }
                self.tidy(&mut st, keys);
            });
            let out = call();
            unwinding.disarm();
            out
        })
    }

    /// Sleeps until the local turns change (or a spurious wake); [`Error::Timeout`] once
    /// the wait's deadline has passed, [`Error::Cancelled`] once it is cancelled (checked
    /// before sleeping, under the state's mutex, which the canceller's waker takes before
    /// it notifies: a cancel is either seen here or wakes the sleep).
    pub(crate) fn await_change(
        self: &Arc<Self>,
        st: &mut MutexGuard<'_, SharesState>,
        wait: Wait<'_>,
    ) -> Result<()> {
        let _woken = wait.cancel().map(|c| {
            // Weak: a pending waker does not keep the client alive.
            let engine = Arc::downgrade(self);
            c.on_cancel(move || {
                if let Some(engine) = engine.upgrade() {
                    let _state = engine.shares.state.lock();
                    engine.shares.changed.notify_all();
                }
            })
        });
        if wait.cancelled() {
            return Err(Error::Cancelled);
        }
        match wait.deadline() {
            None => self.shares.changed.wait(st),
            Some(d) => {
                if self.shares.changed.wait_until(st, d).timed_out() && Instant::now() >= d {
                    Counters::inc(&self.counters.timeouts);
                    return Err(Error::Timeout);
                }
            }
        }
        Ok(())
    }

    /// Keeps `keys` subscribed on the nodes of its route while the result lives, with the
    /// listeners that hear another process's writer begin to wait (see
    /// `Turn::listening`).
    fn listen(&self, keys: &Keys) -> Vec<(Box<dyn Send>, Box<dyn Probe + Send>)> {
        if self.subs.is_empty() {
            return Vec::new();
        }
        let route = self.topology.route(keys);
        self.subs_for(&route)
            .iter()
            .map(|s| {
                let interest: Box<dyn Send> = Box::new(s.interest(keys));
                let probe: Box<dyn Probe + Send> = Box::new(s.clone());
                (interest, probe)
            })
            .collect()
    }

    /// Whether the process may go on taking turns on `remote`, held as `mode` (the hold is
    /// live and nobody else waits for it), or the first error (which the caller counts as
    /// no: the hold drains and is asked for again). Asked within `deadline`, the asking
    /// thread's: a server that stops answering must not keep that thread past it.
    fn keep_turns(&self, remote: &RemoteLock, deadline: Option<Instant>) -> Result<bool> {
        let route = self.topology.route(&remote.keys);
        for node in route.nodes() {
            let keep = remote
                .protocol
                .keeps_turns(node, &remote.keys, &remote.token, deadline);
            if !keep? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Gives a remote hold back on behalf of the process (nobody waits for the outcome).
    fn give_back(self: &Arc<Self>, remote: &Arc<RemoteLock>) {
        if let Err(e) = self.release_shared(remote) {
            log::debug!("giving a hold back failed (it expires with its lease): {e}");
        }
    }

    /// [`give_back`](Self::give_back), by a thread that waits for a turn as `wait` allows:
    /// one with a deadline (or that may not wait at all) leaves the release to the cleanup
    /// job, since a server that stopped answering would keep it in the release past its
    /// deadline.
    fn give_back_for(self: &Arc<Self>, remote: &Arc<RemoteLock>, wait: Wait<'_>) {
        if !wait.bounded() {
            return self.give_back(remote);
        }
        self.release_in_background(remote);
        if let Some(w) = &self.watchdog {
            w.unregister(remote);
        }
    }

    /// After a change: gives `back` back in Redis if it must go, and forgets the name's
    /// turn when nobody uses it any more.
    fn settle(
        self: &Arc<Self>,
        mut st: MutexGuard<'_, SharesState>,
        keys: &Keys,
        back: Option<Arc<RemoteLock>>,
    ) -> Option<Result<Unlocked>> {
        let outcome = back.map(|remote| {
            let undo = |t: &mut Turn| {
                self.release_in_background(&remote);
                t.released();
            };
            let r = self.unlocked_for(&mut st, keys, undo, || self.release_shared(&remote));
            if let Some(turn) = st.turns.get_mut(keys) {
                turn.released();
            }
            r
        });
        self.tidy(&mut st, keys);
        outcome
    }

    /// Forgets the turn of `keys` when nobody uses it any more, and tells the local
    /// threads waiting for a turn to look again.
    fn tidy(&self, st: &mut SharesState, keys: &Keys) {
        if st.turns.get(keys).is_some_and(|t| t.unused()) {
            st.turns.remove(keys);
        }
        self.shares.changed.notify_all();
    }

    fn sharer(&self, remote: Arc<RemoteLock>, token: u64, path: Path) -> Hold {
        let sharer = NEXT_SHARER.fetch_add(1, Ordering::Relaxed);
        Hold::new(remote, sharer, token, path)
    }

    /// The calling thread's write hold of `remote` leaves the local turns (it becomes a
    /// detached guard, released later with `release_shared`): the thread no longer holds
    /// the name, and the local threads waiting for it ask Redis instead.
    pub(crate) fn detach_write(self: &Arc<Self>, remote: &Arc<RemoteLock>) {
        let me = std::thread::current().id();
        let mut st = self.shares.state.lock();
        st.threads.remove(&(remote.keys.clone(), me));
        if let Some(turn) = st.turns.get_mut(&remote.keys).filter(|t| t.holds(remote)) {
            turn.detach();
        }
        self.settle(st, &remote.keys, None);
    }

    /// A local reader or writer (or upgradable reader) lets go; the last user of a remote
    /// hold that must go gives it back in Redis.
    pub(crate) fn leave_turn(self: &Arc<Self>, hold: &Hold, mode: Mode) -> Result<Unlocked> {
        let remote = &hold.remote;
        remote.remove_sharer(hold.sharer);
        let me = std::thread::current().id();
        let mut st = self.shares.state.lock();
        let key = (remote.keys.clone(), me);
        let last = match st.threads.get_mut(&key) {
            Some(Mine::Read(_, _, n)) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => {
                st.threads.remove(&key);
                true
            }
        };
        // A hold of the thread's own (an upgradable read and what it becomes, or any hold
        // without local handoff) goes back when the thread's last guard on it lets go.
        let Some(turn) = st.turns.get_mut(&remote.keys).filter(|t| t.holds(remote)) else {
            drop(st);
            return match last {
                true => self.release_shared(remote),
                false => Ok(Unlocked::Released),
            };
        };
        let back = turn.leave(mode == Mode::Write);
        let lost = remote.lost(&self.counters);
        match self.settle(st, &remote.keys, back) {
            Some(outcome) => outcome,
            None if lost.is_some() => Ok(Unlocked::Expired),
            None => Ok(Unlocked::Released),
        }
    }

    /// Takes an upgradable read hold of `name`: a remote hold of the thread's own, never
    /// shared with the process's turns (see `local::shares`).
    pub(crate) fn upgradable(self: &Arc<Self>, name: &[u8], wait: Wait<'_>) -> Result<Hold> {
        self.timed(HoldKind::Read, wait, || {
            let keys = Keys::new(&self.cfg.key_prefix, name)?;
            let key = (keys.clone(), std::thread::current().id());
            // Whatever this thread holds of the name, the upgradable read could wait for
            // it: a writer waiting for this thread's hold holds the upgradable one back.
            if self.shares.state.lock().threads.contains_key(&key) {
                return Err(Error::WouldDeadlock);
            }
            let (remote, _) = self.acquire_shared(&keys, Kind::Upgradable, wait)?;
            let token = turn_token(&remote, Mode::Read, 0);
            self.shares
                .state
                .lock()
                .threads
                .insert(key, Mine::Upgradable);
            Ok(self.sharer(remote, token, Path::Remote))
        })
    }

    /// Turns the calling thread's upgradable read `hold` into the write hold, waiting (as
    /// `wait` allows) until the other readers are done. The upgradable hold is retired,
    /// with no release, once the write hold replaced it; on an error it is left as it was
    /// (unless the error says it is lost).
    pub(crate) fn upgrade(self: &Arc<Self>, hold: &Hold, wait: Wait<'_>) -> Result<Hold> {
        self.timed(HoldKind::Write, wait, || {
            let from = &hold.remote;
            let key = self.holding(
                from,
                |m| matches!(m, Mine::Upgradable),
                "an upgradable read",
            )?;
            let keys = &from.keys;
            let route = self.topology.route(keys);
            let won = self.contest(keys, route, Kind::Upgrade, wait, Start::Convert(from));
            // An attempt left unanswered at the deadline (or the cancel) may have run, and
            // the upgradable hold with it: the call says the hold is lost, and is counted
            // as that, not as a timeout.
            let won = won.map_err(|e| match e {
                Error::Timeout | Error::Cancelled => {
                    from.lost(&self.counters).map_or(e, Error::Lost)
                }
                e => e,
            });
            let (remote, _) = self.watched(won).inspect_err(|e| {
                if let Error::Lost(reason) = e {
                    from.mark_lost(*reason, &self.counters);
                }
            })?;
            self.retire(from);
            self.shares.state.lock().threads.insert(key, Mine::Write);
            let token = turn_token(&remote, Mode::Write, 1);
            Ok(self.sharer(remote, token, Path::Remote))
        })
    }

    /// Turns the calling thread's write `hold` into a read hold of the same token, in one
    /// script: no writer gets in between. The process's write hold stays the process's (as
    /// a read hold the local readers may join); a thread's own stays its own. The write
    /// hold is retired, with no release, once the read hold replaced it; on an error it is
    /// left to its guard, and lost when the script may have run (a read hold it may have
    /// made is released in the background, and the write hold may be gone with it).
    pub(crate) fn downgrade(self: &Arc<Self>, hold: &Hold) -> Result<Hold> {
        self.timed(HoldKind::Read, Wait::No, || self.downgrade_now(hold))
    }

    fn downgrade_now(self: &Arc<Self>, hold: &Hold) -> Result<Hold> {
        let from = &hold.remote;
        let keys = &from.keys;
        let key = self.holding(from, |m| matches!(m, Mine::Write), "a write hold")?;
        let route = self.topology.route(keys);
        let protocol = route.protocol(Kind::Read)?;
        let Some(node) = route.sole() else {
            return Err(Error::Unsupported(
                "read-write locks need a single node (not Redlock)",
            ));
        };
        let (member, lease) = (Want::Read.member_like(&from.token), self.cfg.lease);
        // On the lease clock: the read hold's validity counts from here.
        let started = Stamp::now();
        let paused = Paused::new(self, from);
        let done = node.downgrade_shared(keys, &from.token, from.fence, lease, route.retry());
        let unacked = match done {
            Ok((true, unacked)) => {
                paused.replaced();
                unacked
            }
            Ok((false, _)) => {
                drop(paused);
                from.mark_lost(LostReason::Deleted, &self.counters);
                return Err(Error::Lost(LostReason::Deleted));
            }
            Err(e) => {
                drop(paused);
                if may_have_run(&e) {
                    // The write hold may be the read hold now, and that goes back below:
                    // the write hold must not serve anyone again, not even a local turn
                    // (a lost hold admits nobody; the next local writer asks Redis).
                    from.mark_lost(LostReason::Converted, &self.counters);
                    let nodes = vec![node.id.clone()];
                    self.cleanup.release_later(keys, protocol, member, nodes);
                }
                return Err(e);
            }
        };
        let acquisition = Acquisition {
            keys: keys.clone(),
            protocol,
            token: member,
            fence: from.fence,
            previous_lost: false,
            nodes: from.nodes.clone(),
            started,
        };
        let remote = Arc::new(self.remote_lock(acquisition).capped_as(from));
        remote.set_turned_from(from);
        if unacked.is_some() {
            // Too few replicas have the read hold: a failover could bring the write hold
            // back, lasting as long as it was acknowledged. The read hold is trusted no
            // longer, as a lease change of unknown outcome, and renewed (and acknowledged)
            // at once.
            let unknown = Changed::Unknown {
                cap: from.validity(),
                retry_at: Stamp::now(),
            };
            remote.end_renew(unknown, &self.counters);
        }
        if let Some(w) = &self.watchdog {
            w.register(remote.clone(), remote.next_due());
        }
        self.retire(from);
        let token = turn_token(&remote, Mode::Read, 0);
        let mut st = self.shares.state.lock();
        st.threads.insert(key, Mine::Read(remote.clone(), token, 1));
        if let Some(turn) = st.turns.get_mut(keys).filter(|t| t.holds(from)) {
            turn.downgraded(remote.clone());
        }
        drop(st);
        self.shares.changed.notify_all();
        Ok(self.sharer(remote, token, Path::Remote))
    }

    /// The calling thread's entry for the name of `remote`, which it holds as `what` (an
    /// upgrade or a downgrade is made by the holder: the guards are not `Send`, so this
    /// holds unless the state is broken) and which is not known lost.
    fn holding(
        &self,
        remote: &RemoteLock,
        is: fn(&Mine) -> bool,
        what: &str,
    ) -> Result<(Keys, ThreadId)> {
        let key = (remote.keys.clone(), std::thread::current().id());
        if !self.shares.state.lock().threads.get(&key).is_some_and(is) {
            return Err(Error::InvalidArgument(format!(
                "this thread holds no {what} of the name"
            )));
        }
        match remote.lost(&self.counters) {
            Some(reason) => Err(Error::Lost(reason)),
            None => Ok(key),
        }
    }

    /// A hold of ours that another replaced in Redis (upgraded, downgraded) is retired:
    /// no renewal is sent for it any more, no release, and it is never reported lost.
    fn retire(&self, remote: &RemoteLock) {
        remote.begin_release(&self.counters);
        if let Some(w) = &self.watchdog {
            w.unregister(remote);
        }
    }
}

/// A thread that wanted a turn (to write if `write`) no longer waits for one.
fn stop_waiting(turn: &mut Turn, write: bool) {
    let count = turn.waiting(write);
    *count = count.saturating_sub(1);
}

fn want(mode: Mode) -> Kind {
    match mode {
        Mode::Read => Kind::Read,
        Mode::Write => Kind::Write,
    }
}

fn mine(mode: Mode, remote: &Arc<RemoteLock>, token: u64) -> Mine {
    match mode {
        Mode::Read => Mine::Read(remote.clone(), token, 1),
        Mode::Write => Mine::Write,
    }
}

/// A user's fencing token on `remote` (held as `held`), `writes` writes into it (counting
/// the user's own, if it writes). A write's token numbers it within the remote write hold
/// (1, 2, …); a read under a read hold takes the highest number of its fence (above every
/// write of that fence), and under this process's write hold the number of the last write
/// before it (0 before the first: below it).
fn turn_token(remote: &RemoteLock, held: Mode, writes: u32) -> u64 {
    let seq = match held {
        Mode::Read => MAX_LOCAL_SEQ,
        Mode::Write => writes,
    };
    fencing::token(remote.fence, seq)
}
