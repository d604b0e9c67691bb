//! The adversary's moves on the shared holds: the lock model's (`crate::adversary`),
//! with a script that may publish several messages (a grant to each reader).

use crate::net::{Message, Request, put, take};
use crate::shared::State;
use crate::shared::client::{Choice, Effects};
use crate::shared::config::SharedConfig;
use crate::shared::redis::{Op, Publish};

/// One move of the adversary.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Move {
    /// Redis runs a request's script; its reply, and what it published, are delivered
    /// unless lost (the messages of one script all, or none).
    Run {
        request: Request<Op>,
        lose_reply: bool,
        lose_messages: bool,
    },
    DropRequest(Request<Op>),
    /// A message that waited for a paused process reaches it.
    Hear(Message<Publish>),
    /// The same, with a copy left in flight.
    Repeat(Message<Publish>),
    DropMessage(Message<Publish>),
    /// Time advances; `pause`: the process paused during the new tick.
    Tick {
        pause: Option<u8>,
        choices: Vec<Choice>,
    },
}

/// Lists the moves in `s`.
pub fn moves(cfg: &SharedConfig, s: &State, out: &mut Vec<Move>) {
    let faults = s.faults_left;
    for (i, &request) in s.net.requests.iter().enumerate() {
        if i > 0 && s.net.requests[i - 1] == request {
            continue;
        }
        let late = u8::from(request.sent < s.now);
        let p = &s.procs[usize::from(request.from)];
        let replied = p.awaits(&request) && !p.paused;
        let published = !s.redis.clone().run(cfg, s.now, request.op).1.is_empty();
        let listeners = published && s.procs.iter().any(|p| p.waits());
        for lose_reply in [false, true] {
            for lose_messages in [false, true] {
                let cost = late + u8::from(lose_reply) + u8::from(lose_messages);
                if (lose_reply && !replied) || (lose_messages && !listeners) || cost > faults {
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
    for (i, &m) in s.net.messages.iter().enumerate() {
        if i > 0 && s.net.messages[i - 1] == m {
            continue;
        }
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
        if p.paused || s.pauses_left > 0 {
            pauses.push(Some(p.id));
        }
    }
    for pause in pauses {
        let mut next = s.clone();
        begin_tick(cfg, &mut next, pause);
        let mut combos: Vec<Vec<Choice>> = vec![Vec::new()];
        for p in &next.procs {
            combos = combos
                .into_iter()
                .flat_map(|c| {
                    p.choices().into_iter().map(move |x| {
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

/// Not past the horizon, and nothing in flight at its longest delay.
fn may_tick(cfg: &SharedConfig, s: &State) -> bool {
    let overdue = |at: u8| at + cfg.max_delay <= s.now;
    s.now < cfg.horizon
        && !s.net.requests.iter().any(|r| overdue(r.sent))
        && !s
            .net
            .messages
            .iter()
            .any(|m| !s.procs[usize::from(m.to)].paused && overdue(m.at))
}

fn begin_tick(cfg: &SharedConfig, s: &mut State, pause: Option<u8>) {
    s.now += 1;
    s.redis.expire(s.now);
    for p in &mut s.procs {
        let paused = pause == Some(p.id);
        if paused && !p.paused {
            s.pauses_left -= 1;
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

fn lose(s: &mut State) {
    s.faults_left -= 1;
}

pub fn apply(cfg: &SharedConfig, s: &mut State, mv: Move) {
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
                    lose(s);
                }
            }
            if !lose_messages {
                for what in published {
                    let to: Vec<u8> = s.procs.iter().filter(|p| p.waits()).map(|p| p.id).collect();
                    for to in to {
                        hear(cfg, s, Message { at: now, to, what });
                    }
                }
            }
            let p = &mut s.procs[usize::from(request.from)];
            if !lose_reply && p.awaits(&request) && !p.paused {
                let mut fx = Effects::default();
                p.on_reply(cfg, now, request, answer, &mut fx);
                s.effects(fx);
            }
        }
        Move::Hear(m) => {
            take(&mut s.net.messages, &m);
            hear(cfg, s, m);
        }
        Move::Repeat(m) => {
            lose(s);
            hear(cfg, s, m);
        }
        Move::DropRequest(r) => {
            take(&mut s.net.requests, &r);
            lose(s);
        }
        Move::DropMessage(m) => {
            take(&mut s.net.messages, &m);
            lose(s);
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
        }
    }
}

/// A running process hears `m` at once; a paused one when it resumes.
fn hear(cfg: &SharedConfig, s: &mut State, m: Message<Publish>) {
    let p = &mut s.procs[usize::from(m.to)];
    if p.paused {
        put(&mut s.net.messages, m);
        return;
    }
    let mut fx = Effects::default();
    p.hear(cfg, s.now, m.what, &mut fx);
    s.effects(fx);
}
