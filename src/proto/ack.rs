//! The replicas' `WAIT` of `replica_ack` within a call's deadline: the timeout it is sent
//! with, and how a `WAIT` whose read the deadline cut short is told apart from a node that
//! stopped answering (its connection goes, the node is not taken for silent). The `WAIT`
//! itself is sent by [`Node`](crate::proto::node::Node), on the connection of the write it
//! waits for.

use std::time::Duration;

use redis::{ErrorKind, RedisError};

/// What marks a replicas' `WAIT` whose read the call's deadline cut short (see
/// [`wait_cut`]).
pub(crate) const WAIT_CUT: &str = "the replicas' WAIT cut short by the call's deadline";

/// The failure of a replicas' `WAIT` whose read the call's deadline cut short: a network
/// error (the connection still owes the reply, and is dropped), of a node that answered.
pub(crate) fn wait_cut() -> RedisError {
    RedisError::from((ErrorKind::Io, "no reply", WAIT_CUT.to_owned()))
}

/// Whether `e` is [`wait_cut`]'s.
pub(crate) fn is_wait_cut(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Io && e.detail() == Some(WAIT_CUT)
}

/// How late a server may answer a `WAIT` after its own timeout: it looks at blocked
/// clients' timeouts on its clock tick, every 100 ms at the default `hz` of 10.
const WAIT_TICK: Duration = Duration::from_millis(100);

/// The timeout a `WAIT` is sent with: `timeout` (`replica_ack`'s), or less when `left`,
/// what remains of the call's deadline, is shorter: `left` less a server's tick, so that
/// the server's answer (too few acknowledgements) comes within the deadline rather than
/// after the read the deadline cuts short.
pub(crate) fn wait_timeout(timeout: Duration, left: Option<Duration>) -> Duration {
    match left {
        Some(left) if left > WAIT_TICK => timeout.min(left - WAIT_TICK),
        // Too little left to be sure of an answer: half of it, for a replica that is late
        // rather than gone.
        Some(left) => timeout.min(left / 2),
        None => timeout,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `WAIT` is given what the deadline leaves less a server tick, half of it when
    /// less than a tick is left, and its own timeout without a deadline.
    #[test]
    fn a_wait_is_sent_with_what_the_deadline_leaves() {
        let ms = Duration::from_millis;
        assert_eq!(wait_timeout(ms(2_000), None), ms(2_000));
        assert_eq!(wait_timeout(ms(2_000), Some(ms(300))), ms(200));
        assert_eq!(wait_timeout(ms(150), Some(ms(5_000))), ms(150));
        assert_eq!(wait_timeout(ms(2_000), Some(ms(60))), ms(30));
        assert!(is_wait_cut(&wait_cut()));
    }
}
