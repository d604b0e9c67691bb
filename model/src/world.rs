//! What every model is made of, and what the adversary drives in it: the clock, Redis,
//! the client processes, what is in flight, and the history the properties read.
//!
//! The lock (`crate::system`) and the shared holds (`crate::shared`) are each a
//! [`Sim`] of their own Redis, process and history types; [`crate::adversary`] moves
//! either through the three traits here.

use std::fmt::Debug;
use std::hash::Hash;

use crate::net::{Net, Request};

/// A client process, as the adversary drives it.
pub trait Process: Clone + Debug + Eq + Hash {
    /// The model's configuration.
    type Cfg;
    /// A script call.
    type Op: Copy + Debug + Ord + Hash;
    /// A script's reply.
    type Answer: Copy;
    /// A message on the lock's channel.
    type Publish: Copy + Debug + Ord + Hash;
    /// What the process's threads do at the start of a tick.
    type Choice: Clone + Debug + Eq + Hash;
    /// What a step does outside the process.
    type Effects: Default;

    /// Its number and whether it is paused.
    fn pid(&self) -> Pid;
    fn set_paused(&mut self, paused: bool);
    /// Whether `request` is the one whose reply it awaits.
    fn awaits(&self, request: &Request<Self::Op>) -> bool;
    /// Whether it is subscribed: it hears what is published.
    fn listens(&self) -> bool;
    /// Whether the adversary may stall `request` on its way (see `adversary`): none by
    /// default.
    fn may_stall(&self, _cfg: &Self::Cfg, _request: &Request<Self::Op>) -> bool {
        false
    }
    fn choices(&self, cfg: &Self::Cfg, now: u8) -> Vec<Self::Choice>;
    /// The start of a tick for a running process: timeouts.
    fn begin_tick(&mut self, cfg: &Self::Cfg, now: u8, fx: &mut Self::Effects);
    /// What its threads chose, then what falls due.
    fn act(&mut self, cfg: &Self::Cfg, now: u8, choice: Self::Choice, fx: &mut Self::Effects);
    fn hear(&mut self, cfg: &Self::Cfg, now: u8, what: Self::Publish, fx: &mut Self::Effects);
    fn on_reply(
        &mut self,
        cfg: &Self::Cfg,
        now: u8,
        request: Request<Self::Op>,
        answer: Self::Answer,
        fx: &mut Self::Effects,
    );
}

/// Redis: the scripts of `P`'s requests.
pub trait Store<P: Process>: Clone + Debug + Eq + Hash {
    /// Runs `op` at `now`: its reply, and what it published.
    fn run(&mut self, cfg: &P::Cfg, now: u8, op: P::Op) -> (P::Answer, Vec<P::Publish>);
    /// Time reached `now`.
    fn expire(&mut self, now: u8);
}

/// A process's number, and whether it is paused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pid {
    pub id: u8,
    pub paused: bool,
}

/// What the adversary may still do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Budget {
    /// Pauses it may still begin.
    pub pauses_left: u8,
    /// Faults it may still cause: an item in flight lost or duplicated, a request run
    /// after its sender gave up, a request stalled.
    pub faults_left: u8,
    /// Requests it may still stall (each a fault too).
    pub stalls_left: u8,
}

/// The history the properties remember.
pub trait Ledger<R, P: Process>: Clone + Debug + Eq + Hash + Sized {
    /// A fault happened: something lost, a request late, a pause begun or ended.
    fn fault(&mut self) {}
    /// Records what a process's step did outside it.
    fn effects(s: &mut Sim<R, P, Self>, fx: P::Effects);
    /// Time is about to advance: the last moment of a tick.
    fn ticking(_cfg: &P::Cfg, _s: &mut Sim<R, P, Self>) {}
    /// A tick ended.
    fn ticked(_cfg: &P::Cfg, _s: &mut Sim<R, P, Self>) {}
    /// A stalled request landed (its script ran, after its sender moved on), answered
    /// `answer`.
    fn landed(_s: &mut Sim<R, P, Self>, _request: Request<P::Op>, _answer: P::Answer) {}
    /// The adversary dropped `request` on its way (a fault): its script never runs.
    fn dropped(_s: &mut Sim<R, P, Self>, _request: Request<P::Op>) {}
}

/// A whole system at one moment.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sim<R, P: Process, H> {
    /// The current tick (every clock reads it: clocks are exact).
    pub now: u8,
    pub redis: R,
    pub procs: Vec<P>,
    pub net: Net<P::Op, P::Publish>,
    pub budget: Budget,
    pub history: H,
}

impl<R, P: Process, H> Sim<R, P, H> {
    /// Something in flight was lost or duplicated, or a request ran late: one fault.
    pub fn lose(&mut self)
    where
        H: Ledger<R, P>,
    {
        self.budget.faults_left -= 1;
        self.history.fault();
    }

    /// Messages to processes that no longer listen change nothing: forgotten, so that
    /// equal situations are equal states.
    pub fn forget_unheard(&mut self) {
        let procs = &self.procs;
        self.net
            .messages
            .retain(|m| procs[usize::from(m.to)].listens());
    }
}
