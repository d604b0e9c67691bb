//! Redlock's fencing tokens: several independent nodes, each with its own counter and
//! clock, and the rule that makes the tokens of successive holders increase although the
//! counters drift apart.
//!
//! Each node issues a fence as the library's acquire script does (`next_fence`):
//! `max(last + 1, its clock)`, also in a round that fails. A round that a majority grants
//! takes the highest of the granting nodes' fences, and raises the counters of the
//! granting nodes behind it to it (`RAISE_FENCE`: only ever up); each raise may run, fail
//! on its way, or run with its reply lost. The hold is handed out when the nodes that
//! carry its fence (those that issued it and those whose raise was answered) are a
//! majority, and otherwise undone ([`Hand::Majority`], what the library does); the broken
//! variant [`Hand::Always`] hands it out whatever the raises did. A hold ends released
//! (its fence written back where the release arrives: `SET … XX`) or crashed (its keys
//! expire). Clocks advance one node at a time, so they drift apart; a node may also start
//! with its counter ahead of the others' (fences they never saw).
//!
//! Holds never overlap here (the exclusion of Redlock is another matter, a majority's):
//! each round starts after the last hold ended, and the property is that every token
//! handed out is above every token handed out before.

use stateright::{Model, Property};

/// Nodes.
pub const NODES: usize = 3;
const QUORUM: usize = NODES / 2 + 1;

/// How a round that a majority granted is handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Hand {
    /// When the nodes carrying its fence are a majority (the library's rule).
    Majority,
    /// Whatever the raises did (broken).
    Always,
}

/// The bounds of one check.
#[derive(Debug, Clone, Copy)]
pub struct RedlockConfig {
    pub hand: Hand,
    /// Acquisition rounds, in all.
    pub rounds: u8,
    /// How far any node's clock may advance.
    pub max_clock: u64,
    /// The counter node 0 starts with (the others start with none).
    pub ahead: u64,
}

impl RedlockConfig {
    /// The library's rule, within bounds that take a few seconds to check.
    pub fn ci() -> Self {
        RedlockConfig {
            hand: Hand::Majority,
            rounds: 4,
            max_clock: 3,
            ahead: 6,
        }
    }

    /// The same bounds, with every hold handed out.
    pub fn broken() -> Self {
        RedlockConfig {
            hand: Hand::Always,
            ..Self::ci()
        }
    }
}

/// A set of nodes, one bit each.
type Nodes = u8;

fn count(nodes: Nodes) -> usize {
    nodes.count_ones() as usize
}

fn each(nodes: Nodes) -> impl Iterator<Item = usize> {
    (0..NODES).filter(move |i| nodes & (1 << i) != 0)
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Phase {
    Idle,
    /// A majority granted `fence`; `pending` raises are on their way, `raised` answered.
    Raising {
        fence: u64,
        granted: Nodes,
        carried: Nodes,
        pending: Nodes,
    },
    Holding {
        fence: u64,
        granted: Nodes,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct State {
    /// Each node's counter (0: none).
    pub counters: [u64; NODES],
    pub clocks: [u64; NODES],
    pub phase: Phase,
    pub rounds: u8,
    /// The highest token handed out so far.
    pub last: u64,
    /// A token was handed out that was not above one handed out before.
    pub regressed: bool,
    /// A majority granted a hold that the raises left carried by too few nodes.
    pub refused: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Action {
    Tick(usize),
    /// A round granted by these nodes (each issues a fence).
    Round(Nodes),
    /// A raise runs and its reply arrives.
    Raised(usize),
    /// A raise is lost on its way: it never runs.
    RaiseLost(usize),
    /// A raise runs; its reply is lost.
    RaiseUnanswered(usize),
    /// The release arrives at these nodes.
    Release(Nodes),
    /// The holder crashes: its keys expire, nothing is written back.
    Crash,
}

pub struct RedlockModel {
    pub cfg: RedlockConfig,
}

/// The property checked.
pub const INCREASING: &str = "tokens of successive holders increase";

impl Model for RedlockModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let mut counters = [0; NODES];
        counters[0] = self.cfg.ahead;
        vec![State {
            counters,
            clocks: [1; NODES],
            phase: Phase::Idle,
            rounds: 0,
            last: 0,
            regressed: false,
            refused: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        for i in 0..NODES {
            if s.clocks[i] < self.cfg.max_clock {
                actions.push(Action::Tick(i));
            }
        }
        match &s.phase {
            Phase::Idle if s.rounds < self.cfg.rounds => {
                actions.extend((1..(1 << NODES)).map(Action::Round));
            }
            Phase::Idle => {}
            Phase::Raising { pending, .. } => {
                for i in each(*pending) {
                    actions.extend([
                        Action::Raised(i),
                        Action::RaiseLost(i),
                        Action::RaiseUnanswered(i),
                    ]);
                }
            }
            Phase::Holding { granted, .. } => {
                actions.extend(
                    (0..(1 << NODES))
                        .filter(|m| m & !granted == 0)
                        .map(Action::Release),
                );
                actions.push(Action::Crash);
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Tick(i) => s.clocks[i] += 1,
            Action::Round(granted) => {
                s.rounds += 1;
                let mut fences = [0; NODES];
                for i in each(granted) {
                    fences[i] = (s.counters[i] + 1).max(s.clocks[i]);
                    s.counters[i] = fences[i];
                }
                if count(granted) >= QUORUM {
                    let fence = fences.iter().copied().max().unwrap_or(0);
                    let carried = each(granted)
                        .filter(|&i| fences[i] == fence)
                        .fold(0, |m, i| m | 1 << i);
                    s.phase = Phase::Raising {
                        fence,
                        granted,
                        carried,
                        pending: granted & !carried,
                    };
                    self.decide(&mut s);
                }
                // A round without a majority is undone: giving an attempt back leaves the
                // counters as they are.
            }
            Action::Raised(i) | Action::RaiseLost(i) | Action::RaiseUnanswered(i) => {
                let Phase::Raising {
                    fence,
                    carried,
                    pending,
                    ..
                } = &mut s.phase
                else {
                    return None;
                };
                *pending &= !(1 << i);
                if !matches!(action, Action::RaiseLost(_)) {
                    s.counters[i] = s.counters[i].max(*fence);
                }
                if matches!(action, Action::Raised(_)) {
                    *carried |= 1 << i;
                }
                self.decide(&mut s);
            }
            Action::Release(reached) => {
                let Phase::Holding { fence, .. } = s.phase else {
                    return None;
                };
                for i in each(reached) {
                    if s.counters[i] != 0 {
                        s.counters[i] = fence;
                    }
                }
                s.phase = Phase::Idle;
            }
            Action::Crash => s.phase = Phase::Idle,
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(INCREASING, |_, s: &State| !s.regressed),
            Property::sometimes("a hold handed out", |_, s: &State| s.last > 0),
            Property::sometimes("a hold refused for its raises", |_, s: &State| s.refused),
        ]
    }
}

impl RedlockModel {
    pub fn new(cfg: RedlockConfig) -> Self {
        RedlockModel { cfg }
    }

    /// Once every raise is answered or lost: hands the hold out, or undoes it.
    fn decide(&self, s: &mut State) {
        let Phase::Raising {
            fence,
            granted,
            carried,
            pending: 0,
        } = s.phase
        else {
            return;
        };
        if self.cfg.hand == Hand::Majority && count(carried) < QUORUM {
            s.refused = true;
            s.phase = Phase::Idle;
            return;
        }
        s.regressed |= fence <= s.last;
        s.last = s.last.max(fence);
        s.phase = Phase::Holding { fence, granted };
    }
}
