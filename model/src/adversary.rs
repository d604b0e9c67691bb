//! The adversary: the network, the scheduler and the clock. Every action of a model is
//! one of its moves; the clients react within them. The same moves drive the lock
//! (`crate::system`) and the shared holds (`crate::shared`), through `crate::world`.
//!
//! - **Run** a request's script at Redis, in any order, at the tick it was sent or up to
//!   `Config::max_delay` ticks later (so after its sender gave up, at `Config::timeout`),
//!   or **drop** it. A request that time leaves in flight is late: one fault each, paid
//!   at the tick that leaves it (so a tick that would make more requests late than the
//!   budget allows is not taken); running, dropping or stalling it later costs nothing
//!   more for its lateness. With each run the reply is delivered or lost, and what the
//!   script published is delivered or lost. A reply is delivered at once or never: one
//!   later than the client's timeout is thrown away (as if lost), and one late but within
//!   it would only make the client act later in the same tick. A paused process gets no
//!   reply (its timeout comes first when it resumes); its messages wait for it, then are
//!   **heard**, **repeated** (heard with a copy left in flight: a duplicate, one fault)
//!   or **dropped**.
//! - **Tick**: time advances by one; the adversary chooses which process (at most one)
//!   is paused during the new tick — a paused process takes no step and receives nothing
//!   while time goes on — and each running process, in turn, times out what went
//!   unanswered, does what its threads chose (lock, unlock, hand off, extend, or
//!   nothing), renews if due and attempts if due. Threads act at tick starts only, one
//!   choice per process per tick. Time does not advance while something in flight is at
//!   its longest delay; at most `Config::pauses` pauses begin, at most `Config::faults`
//!   faults happen, and no tick goes past `Config::horizon`. A script publishes any
//!   number of messages (a grant to each reader); they are delivered or lost together.
//! - **Stall** a request the process allows (`Process::may_stall`: the first send of an
//!   acquisition attempt, of the lock or of a shared hold, or of an upgrade), one at a time, at most `Config::stalls` in all (the
//!   budget's `stalls_left`), each a fault: it is held back and **lands** at any later
//!   tick past its longest ordinary delay, up to `Bounds::stall` ticks after it was
//!   sent, or never. Its sender gave up on it long
//!   since: it is the first send of an attempt that a retry on a fresh connection
//!   overtook.
//! - **Fire** a job of a client's cleanup thread (`net::Job`): its give-back runs at any
//!   step while the job lives, as often as it likes; the library makes it, then looks
//!   again at pauses that double. Time does not advance while a job would change Redis:
//!   a late landing it gives back is given back within the tick it landed. (The
//!   library's pauses give it back within about as long as the landing was late: a
//!   finer clock than the model's.)

use crate::net::{Job, Message, Request, put, take};
use crate::world::{Ledger, Process, Sim, Store};

/// One move of the adversary.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Move<P: Process> {
    /// Redis runs the script of a request; its reply and its messages are delivered
    /// unless lost.
    Run {
        request: Request<P::Op>,
        lose_reply: bool,
        lose_messages: bool,
    },
    DropRequest(Request<P::Op>),
    /// A message that waited for a paused process reaches it.
    Hear(Message<P::Publish>),
    /// The same, and a copy of it stays in flight: a duplicated message.
    Repeat(Message<P::Publish>),
    DropMessage(Message<P::Publish>),
    /// A request is held back on its way (a fault).
    Stall(Request<P::Op>),
    /// The stalled request lands: Redis runs its script.
    Land {
        request: Request<P::Op>,
        lose_messages: bool,
    },
    /// A job of a cleanup thread runs its give-back.
    Fire {
        job: Job<P::Op>,
        lose_messages: bool,
    },
    /// Time advances; `pause`: the process paused during the new tick; `choices`: what
    /// each process's threads do at its start.
    Tick {
        pause: Option<u8>,
        choices: Vec<P::Choice>,
    },
}

/// The bounds the adversary keeps: from the model's configuration.
pub trait Bounds {
    /// The longest a request, or a message to a running process, stays in flight.
    fn max_delay(&self) -> u8;
    /// The last tick.
    fn horizon(&self) -> u8;
    /// The latest a stalled request lands, in ticks after it was sent.
    fn stall(&self) -> u8 {
        0
    }
}

/// Lists the adversary's moves in `s`.
pub fn moves<R, P, H>(cfg: &P::Cfg, s: &Sim<R, P, H>, out: &mut Vec<Move<P>>)
where
    R: Store<P>,
    P: Process,
    P::Cfg: Bounds,
    H: Ledger<R, P>,
{
    let faults = s.budget.faults_left;
    for &request in dedup(&s.net.requests) {
        // Only outcomes that differ are listed: a reply nobody awaits is thrown away
        // either way, a message nobody listens to too. A late request's fault was paid
        // as time went past it (`begin_tick`).
        let (_, published) = s.redis.clone().run(cfg, s.now, request.op);
        let p = &s.procs[usize::from(request.from)];
        let replied = p.awaits(&request) && !p.pid().paused;
        let listeners = !published.is_empty() && s.procs.iter().any(P::listens);
        for lose_reply in [false, true] {
            if lose_reply && !replied {
                continue;
            }
            for lose_messages in [false, true] {
                let cost = u8::from(lose_reply) + u8::from(lose_messages);
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
        // Dropping or holding back a request that is late already costs nothing more:
        // the fault of its sender giving up on it is the one paid.
        if faults > 0 || request.sent < s.now {
            out.push(Move::DropRequest(request));
            if s.budget.stalls_left > 0 && s.net.stalled.is_none() && p.may_stall(cfg, &request) {
                out.push(Move::Stall(request));
            }
        }
    }
    let listeners = s.procs.iter().any(P::listens);
    if let Some(request) = s.net.stalled
        && request.sent + cfg.max_delay() < s.now
    {
        let (_, published) = s.redis.clone().run(cfg, s.now, request.op);
        for lose_messages in [false, true] {
            if !lose_messages || (listeners && !published.is_empty() && faults > 0) {
                out.push(Move::Land {
                    request,
                    lose_messages,
                });
            }
        }
    }
    for &job in dedup(&s.net.jobs) {
        // A give-back that finds nothing to give back changes nothing: not listed.
        let Some(published) = fires(cfg, s, &job) else {
            continue;
        };
        for lose_messages in [false, true] {
            if !lose_messages || (listeners && !published.is_empty() && faults > 0) {
                out.push(Move::Fire { job, lose_messages });
            }
        }
    }
    for &m in dedup(&s.net.messages) {
        if !s.procs[usize::from(m.to)].pid().paused {
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
        if p.pid().paused || s.budget.pauses_left > 0 {
            pauses.push(Some(p.pid().id));
        }
    }
    for pause in pauses {
        let mut next = s.clone();
        begin_tick(cfg, &mut next, pause);
        let mut combos: Vec<Vec<P::Choice>> = vec![Vec::new()];
        for p in &next.procs {
            let choices = p.choices(cfg, next.now);
            combos = combos
                .into_iter()
                .flat_map(|c| {
                    choices.iter().map(move |x| {
                        let mut c = c.clone();
                        c.push(x.clone());
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

/// What firing `job` publishes, if it changes Redis.
fn fires<R: Store<P>, P: Process, H>(
    cfg: &P::Cfg,
    s: &Sim<R, P, H>,
    job: &Job<P::Op>,
) -> Option<Vec<P::Publish>> {
    let mut redis = s.redis.clone();
    let (_, published) = redis.run(cfg, s.now, job.op);
    (redis != s.redis).then_some(published)
}

/// Whether time may advance: not past the horizon, nothing in flight at its longest
/// delay (a paused process's messages wait for it), no job with something to give
/// back, and a fault left for each request that the tick makes late.
fn may_tick<R: Store<P>, P: Process<Cfg: Bounds>, H>(cfg: &P::Cfg, s: &Sim<R, P, H>) -> bool {
    let overdue = |at: u8| at + cfg.max_delay() <= s.now;
    s.now < cfg.horizon()
        && made_late(s) <= usize::from(s.budget.faults_left)
        && !s.net.requests.iter().any(|r| overdue(r.sent))
        && !s
            .net
            .messages
            .iter()
            .any(|m| !s.procs[usize::from(m.to)].pid().paused && overdue(m.at))
        && !s.net.jobs.iter().any(|j| fires(cfg, s, j).is_some())
}

/// How many requests in flight were sent in the current tick: each is late once time
/// advances.
fn made_late<R, P: Process, H>(s: &Sim<R, P, H>) -> usize {
    s.net.requests.iter().filter(|r| r.sent == s.now).count()
}

/// The first part of a tick: time advances, keys expire, pauses change, and running
/// processes time out what went unanswered.
fn begin_tick<R, P, H>(cfg: &P::Cfg, s: &mut Sim<R, P, H>, pause: Option<u8>)
where
    R: Store<P>,
    P: Process,
    P::Cfg: Bounds,
    H: Ledger<R, P>,
{
    // A request left in flight as time goes on is late: its sender gives up on it (or
    // will), one fault each, paid now, when the delay happens, rather than when it
    // runs or is dropped. Paid later, a delay that stopped the clock for its sender
    // went uncounted in between, and a request left in flight once the budget was
    // spent could neither run nor be dropped.
    for _ in 0..made_late(s) {
        s.lose();
    }
    s.now += 1;
    s.redis.expire(s.now);
    let now = s.now;
    s.net.jobs.retain(|j| now < j.until);
    if s.net.stalled.is_some_and(|r| r.sent + cfg.stall() < now) {
        s.net.stalled = None;
    }
    for p in &mut s.procs {
        let paused = pause == Some(p.pid().id);
        if paused != p.pid().paused {
            s.history.fault();
            if paused {
                s.budget.pauses_left -= 1;
            }
        }
        p.set_paused(paused);
    }
    for i in 0..s.procs.len() {
        if !s.procs[i].pid().paused {
            let mut fx = P::Effects::default();
            s.procs[i].begin_tick(cfg, s.now, &mut fx);
            H::effects(s, fx);
        }
    }
}

/// Applies `mv` to `s`.
pub fn apply<R, P, H>(cfg: &P::Cfg, s: &mut Sim<R, P, H>, mv: Move<P>)
where
    R: Store<P>,
    P: Process,
    P::Cfg: Bounds,
    H: Ledger<R, P>,
{
    let now = s.now;
    match mv {
        Move::Run {
            request,
            lose_reply,
            lose_messages,
        } => {
            take(&mut s.net.requests, &request);
            let (answer, published) = s.redis.run(cfg, now, request.op);
            for lost in [lose_reply, lose_messages] {
                if lost {
                    s.lose();
                }
            }
            if !lose_messages {
                for what in published {
                    publish(cfg, s, what);
                }
            }
            // The reply reaches its process if it still awaits it and runs.
            let p = &mut s.procs[usize::from(request.from)];
            if !lose_reply && p.awaits(&request) && !p.pid().paused {
                let mut fx = P::Effects::default();
                p.on_reply(cfg, now, request, answer, &mut fx);
                H::effects(s, fx);
            }
        }
        Move::Hear(m) => {
            take(&mut s.net.messages, &m);
            hear(cfg, s, m);
        }
        Move::Repeat(m) => {
            s.lose();
            hear(cfg, s, m);
        }
        Move::DropRequest(r) => {
            take(&mut s.net.requests, &r);
            if r.sent == now {
                s.lose();
            }
            H::dropped(s, r);
        }
        Move::Stall(r) => {
            take(&mut s.net.requests, &r);
            s.net.stalled = Some(r);
            s.budget.stalls_left -= 1;
            if r.sent == now {
                s.lose();
            }
        }
        Move::Land {
            request,
            lose_messages,
        } => {
            s.net.stalled = None;
            let (answer, published) = s.redis.run(cfg, now, request.op);
            deliver(cfg, s, published, lose_messages);
            H::landed(s, request, answer);
            let p = &mut s.procs[usize::from(request.from)];
            if p.awaits(&request) && !p.pid().paused {
                let mut fx = P::Effects::default();
                p.on_reply(cfg, now, request, answer, &mut fx);
                H::effects(s, fx);
            }
        }
        Move::Fire { job, lose_messages } => {
            let (_, published) = s.redis.run(cfg, now, job.op);
            deliver(cfg, s, published, lose_messages);
        }
        Move::DropMessage(m) => {
            take(&mut s.net.messages, &m);
            s.lose();
        }
        Move::Tick { pause, choices } => {
            H::ticking(cfg, s);
            begin_tick(cfg, s, pause);
            for (i, choice) in choices.into_iter().enumerate() {
                if !s.procs[i].pid().paused {
                    let mut fx = P::Effects::default();
                    s.procs[i].act(cfg, s.now, choice, &mut fx);
                    H::effects(s, fx);
                }
            }
            H::ticked(cfg, s);
        }
    }
}

/// What a script published: heard, or lost (one fault).
fn deliver<R, P, H>(cfg: &P::Cfg, s: &mut Sim<R, P, H>, published: Vec<P::Publish>, lost: bool)
where
    R: Store<P>,
    P: Process,
    H: Ledger<R, P>,
{
    if lost {
        s.lose();
        return;
    }
    for what in published {
        publish(cfg, s, what);
    }
}

/// Every process subscribed now hears `what`, each on its own connection: at once, or
/// when it resumes.
fn publish<R, P, H>(cfg: &P::Cfg, s: &mut Sim<R, P, H>, what: P::Publish)
where
    R: Store<P>,
    P: Process,
    H: Ledger<R, P>,
{
    let now = s.now;
    let to: Vec<u8> = s
        .procs
        .iter()
        .filter(|p| p.listens())
        .map(|p| p.pid().id)
        .collect();
    for to in to {
        hear(cfg, s, Message { at: now, to, what });
    }
}

fn hear<R, P, H>(cfg: &P::Cfg, s: &mut Sim<R, P, H>, m: Message<P::Publish>)
where
    R: Store<P>,
    P: Process,
    H: Ledger<R, P>,
{
    let p = &mut s.procs[usize::from(m.to)];
    if p.pid().paused {
        put(&mut s.net.messages, m);
        return;
    }
    let mut fx = P::Effects::default();
    p.hear(cfg, s.now, m.what, &mut fx);
    H::effects(s, fx);
}
