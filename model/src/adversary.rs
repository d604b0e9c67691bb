//! The adversary: the network, the scheduler and the clock. Every action of the model
//! is one of its moves; the clients react within them.
//!
//! - **Run** a request's script at Redis, in any order, at the tick it was sent or up to
//!   `Config::max_delay` ticks later (so after its sender gave up, at `Config::timeout`),
//!   or **drop** it. With each run the reply is delivered or lost, and what the script
//!   published is delivered or lost. A reply is delivered at once or never: one later
//!   than the client's timeout is thrown away (as if lost), and one late but within it
//!   would only make the client act later in the same tick. A paused process gets no
//!   reply (its timeout comes first when it resumes); its messages wait for it, then are
//!   **heard**, **repeated** (heard with a copy left in flight: a duplicate, one fault)
//!   or **dropped**.
//! - **Tick**: time advances by one; the adversary chooses which process (at most one)
//!   is paused during the new tick — a paused process takes no step and receives nothing
//!   while time goes on — and each running process, in turn, times out what went
//!   unanswered, does what its threads chose (lock, unlock, hand off, extend, or
//!   nothing), renews if due and attempts if due. Threads act at tick starts only, one
//!   choice per process per tick. Time does not advance while something in flight is at
//!   its longest delay; at most `Config::pauses` pauses begin, at most `Config::losses`
//!   items are lost, and no tick goes past `Config::horizon`.

use crate::client::{Choice, Effects};
use crate::config::Config;
use crate::net::{Message, Reply, Request, put, take};
use crate::redis::Publish;
use crate::system::State;

/// One move of the adversary.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Move {
    /// Redis runs the script of a request; its reply and its messages are delivered
    /// unless lost.
    Run {
        request: Request,
        lose_reply: bool,
        lose_messages: bool,
    },
    DropRequest(Request),
    /// A message that waited for a paused process reaches it.
    Hear(Message),
    /// The same, and a copy of it stays in flight: a duplicated message.
    Repeat(Message),
    DropMessage(Message),
    /// Time advances; `pause`: the process paused during the new tick; `choices`: what
    /// each process's threads do at its start.
    Tick {
        pause: Option<u8>,
        choices: Vec<Choice>,
    },
}

/// Lists the adversary's moves in `s`.
pub fn moves(cfg: &Config, s: &State, out: &mut Vec<Move>) {
    let faults = s.history.faults_left;
    for &request in dedup(&s.net.requests) {
        // A request run after the tick it was sent in is late: its sender gave up.
        let late = u8::from(request.sent < s.now);
        // Only outcomes that differ are listed: a reply nobody awaits is thrown away
        // either way, a message nobody listens to too.
        let mut redis = s.redis.clone();
        let (_, published) = redis.run(cfg, s.now, request.op);
        let p = &s.procs[usize::from(request.from)];
        let replied = p.awaits(&request) && !p.paused;
        let listeners = published.is_some() && s.procs.iter().any(|p| p.contending().is_some());
        for lose_reply in [false, true] {
            if lose_reply && !replied {
                continue;
            }
            for lose_messages in [false, true] {
                let cost = late + u8::from(lose_reply) + u8::from(lose_messages);
                if (lose_messages && !listeners) || cost > faults {
                    continue;
                }
                out.push(Move::Run {
                    request,
                    lose_reply,
                    lose_messages,
                });
            }
        }
        if faults > 0 {
            out.push(Move::DropRequest(request));
        }
    }
    for &m in dedup(&s.net.messages) {
        if !s.procs[usize::from(m.to)].paused {
            out.push(Move::Hear(m));
            if faults > 0 {
                out.push(Move::Repeat(m));
            }
        }
        if faults > 0 {
            out.push(Move::DropMessage(m));
        }
    }
    if !may_tick(cfg, s) {
        return;
    }
    let mut pauses = vec![None];
    for p in &s.procs {
        if p.paused || s.history.pauses_left > 0 {
            pauses.push(Some(p.id));
        }
    }
    for pause in pauses {
        let mut next = s.clone();
        begin_tick(cfg, &mut next, pause);
        let mut combos: Vec<Vec<Choice>> = vec![Vec::new()];
        for p in &next.procs {
            let choices = p.choices(cfg, next.now);
            combos = combos
                .into_iter()
                .flat_map(|c| {
                    choices.iter().map(move |&x| {
                        let mut c = c.clone();
                        c.push(x);
                        c
                    })
                })
                .collect();
        }
        out.extend(
            combos
                .into_iter()
                .map(|choices| Move::Tick { pause, choices }),
        );
    }
}

/// Equal items of a multiset give the same moves: list each once.
fn dedup<T: PartialEq>(items: &[T]) -> impl Iterator<Item = &T> {
    items
        .iter()
        .enumerate()
        .filter(|(i, x)| *i == 0 || items[i - 1] != **x)
        .map(|(_, x)| x)
}

/// Whether time may advance: not past the horizon, and nothing in flight at its longest
/// delay (a paused process's messages wait for it).
fn may_tick(cfg: &Config, s: &State) -> bool {
    let overdue = |at: u8| at + cfg.max_delay <= s.now;
    s.now < cfg.horizon
        && !s.net.requests.iter().any(|r| overdue(r.sent))
        && !s
            .net
            .messages
            .iter()
            .any(|m| !s.procs[usize::from(m.to)].paused && overdue(m.at))
}

/// The first part of a tick: time advances, keys expire, pauses change, and running
/// processes time out what went unanswered.
fn begin_tick(cfg: &Config, s: &mut State, pause: Option<u8>) {
    s.now += 1;
    s.redis.expire(s.now);
    for p in &mut s.procs {
        let paused = pause == Some(p.id);
        if paused != p.paused {
            s.history.fault();
            if paused {
                s.history.pauses_left -= 1;
            }
        }
        p.paused = paused;
    }
    for i in 0..s.procs.len() {
        if !s.procs[i].paused {
            let mut fx = Effects::default();
            s.procs[i].begin_tick(cfg, s.now, &mut fx);
            s.effects(fx);
        }
    }
}

/// Applies `mv` to `s`.
pub fn apply(cfg: &Config, s: &mut State, mv: Move) {
    let now = s.now;
    match mv {
        Move::Run {
            request,
            lose_reply,
            lose_messages,
        } => {
            take(&mut s.net.requests, &request);
            let (answer, published) = s.redis.run(cfg, now, request.op);
            for lost in [request.sent < now, lose_reply, lose_messages] {
                if lost {
                    s.history.lose();
                }
            }
            if let Some(what) = published.filter(|_| !lose_messages) {
                publish(cfg, s, what);
            }
            if !lose_reply {
                deliver(
                    cfg,
                    s,
                    Reply {
                        at: now,
                        request,
                        answer,
                    },
                );
            }
        }
        Move::Hear(m) => {
            take(&mut s.net.messages, &m);
            hear(cfg, s, m);
        }
        Move::Repeat(m) => {
            s.history.lose();
            hear(cfg, s, m);
        }
        Move::DropRequest(r) => {
            take(&mut s.net.requests, &r);
            s.history.lose();
        }
        Move::DropMessage(m) => {
            take(&mut s.net.messages, &m);
            s.history.lose();
        }
        Move::Tick { pause, choices } => {
            begin_tick(cfg, s, pause);
            for (i, choice) in choices.into_iter().enumerate() {
                if !s.procs[i].paused {
                    let mut fx = Effects::default();
                    s.procs[i].act(cfg, s.now, choice, &mut fx);
                    s.effects(fx);
                }
            }
            let starving = crate::props::starving(s);
            s.history.tick(starving);
        }
    }
}

/// Every process subscribed now (a contender) hears `what`, each on its own connection:
/// at once, or when it resumes.
fn publish(cfg: &Config, s: &mut State, what: Publish) {
    let now = s.now;
    let to: Vec<u8> = s
        .procs
        .iter()
        .filter(|p| p.contending().is_some())
        .map(|p| p.id)
        .collect();
    for to in to {
        hear(cfg, s, Message { at: now, to, what });
    }
}

fn hear(cfg: &Config, s: &mut State, m: Message) {
    let p = &mut s.procs[usize::from(m.to)];
    if p.paused {
        put(&mut s.net.messages, m);
        return;
    }
    let mut fx = Effects::default();
    p.hear(cfg, s.now, m.what, &mut fx);
    s.effects(fx);
}

/// The reply reaches its process if it still awaits it and runs.
fn deliver(cfg: &Config, s: &mut State, r: Reply) {
    let p = &mut s.procs[usize::from(r.request.from)];
    if !p.awaits(&r.request) || p.paused {
        return;
    }
    let mut fx = Effects::default();
    p.on_reply(cfg, s.now, r.request, r.answer, &mut fx);
    s.effects(fx);
}
