//! What an event on a subscribed channel means for the key's waiters, and the counters a
//! waiter compares before and after its attempt.
//!
//! Keyspace `del`, `expired`, `evicted` (anything but `set` and `expire`) and the
//! library's `r` mean "the key may be free": every waiter of the key retries. `r` right
//! after a `del` is the same release (the subscriber skips it for them). `set` means
//! another owner took it (it ends a yielding contender's pause). `expire` is a renewal and
//! wakes nobody. `c<id>` from another client means it failed to get the key: the holder's
//! process applies its fairness budget.
//!
//! The waiters of read-write locks and semaphores hear only the library's messages (their
//! holds expire inside the key, with no keyspace event): `r`, and a writer its own
//! wake-up `g<member>:0`. A fair queue's grant is `g<token>:<nonce>:<fence>:<grant ms>`
//! (see `fair_scripts`).
//! The waiters of a countdown latch hear only the library's `z`: its count reached zero.

use std::time::{Duration, Instant};

use crate::proto::keys::{lock_of_channel, lock_of_keyspace_channel};

/// The counters a waiter compares before and after its attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub confirmed: bool,
    pub generation: u64,
    /// Events after which the key may be free (`del`, `expired`, the library's `r`...).
    pub freed: u64,
    /// The library's `r` messages: a shared hold ended (waiters of read-write locks and
    /// semaphores hear only these, and a writer its own wake-up).
    pub released: u64,
    /// Events where someone set the key (another process took it).
    pub taken: u64,
    /// The library's `z` messages: a countdown latch of the name reached zero.
    pub opened: u64,
    /// Times the key's slot moved away from the node (Redis Cluster, sharded channels).
    pub moved: u64,
    /// Without keyspace notifications: when the last grant to another process's waiter was
    /// heard, and its lease. Nothing is heard when such a grant runs out untaken (its
    /// grantee died): its lease says when to look again.
    pub lapse: Option<(Instant, Duration)>,
}

pub(crate) use crate::proto::protocol::Hears;

/// What a grant message says to its token's waiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    /// The nonce of the attempt whose queue entry was granted; 0 for a writer's wake-up
    /// (`g<member>:0`), which is never an attempt's.
    pub nonce: u64,
    pub fence: u64,
    /// The grant's lease, counted from when the grant ran.
    pub lease: Duration,
}

/// The token of a grant message and what it says: `g<token>:<nonce>:<fence>:<grant ms>`
/// (a fair queue's grant), or `g<member>:<n>` (a writer's wake-up: nonce 0).
pub(crate) fn grant_of(payload: &[u8]) -> Option<(&[u8], Grant)> {
    let rest = payload.strip_prefix(b"g")?;
    let number = |field: &[u8]| -> Option<u64> { std::str::from_utf8(field).ok()?.parse().ok() };
    let fields: Vec<&[u8]> = rest.rsplitn(4, |&b| b == b':').collect();
    if let [ms, fence, nonce, token] = fields[..]
        && let (Some(ms), Some(fence), Some(nonce)) = (number(ms), number(fence), number(nonce))
    {
        let lease = Duration::from_millis(ms);
        return Some((
            token,
            Grant {
                nonce,
                fence,
                lease,
            },
        ));
    }
    let colon = rest.iter().rposition(|&b| b == b':')?;
    let fence = number(&rest[colon + 1..])?;
    let lease = Duration::ZERO;
    Some((
        &rest[..colon],
        Grant {
            nonce: 0,
            fence,
            lease,
        },
    ))
}

/// What one message says about its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// Keyspace `del`: freed, and the library's `r` for the same release follows.
    Deleted,
    /// The library's `r`: our release script deleted the key.
    Released,
    /// Expired, evicted, renamed away...: the key may be free.
    Freed,
    /// Someone set the key: another owner took it.
    Taken,
    /// Another client failed to get the key.
    Contended,
    /// A release granted the lock to a queued waiter (`g<token>:<nonce>:<fence>:<ms>`),
    /// or woke a waiting writer (`g<member>:0`).
    Granted,
    /// A countdown latch of the name reached zero (`z`).
    Opened,
    /// Nothing a waiter cares about (a renewal, our own failed attempt, an unknown payload).
    Ignored,
}

/// The lock key a message is about and what it means, or `None` when the channel is not
/// one of ours. `client_id`: this client's id, whose own contention marks are ignored.
pub(crate) fn classify<'a>(
    channel: &'a [u8],
    payload: &[u8],
    client_id: &[u8],
) -> Option<(&'a [u8], Event)> {
    if let Some(lock) = lock_of_keyspace_channel(channel) {
        let event = match payload {
            // Our own renewals (`expire`) must not wake every waiter each renew interval.
            b"expire" => Event::Ignored,
            b"set" => Event::Taken,
            b"del" => Event::Deleted,
            // expired, evicted, rename_from, move_from, ...: the key may be free.
            _ => Event::Freed,
        };
        return Some((lock, event));
    }
    let lock = lock_of_channel(channel)?;
    let event = match payload {
        b"r" => Event::Released,
        [b'g', ..] => Event::Granted,
        b"z" => Event::Opened,
        // `c` + the failing client's id: our own failed attempts do not count.
        [b'c', id @ ..] if id != client_id => Event::Contended,
        _ => Event::Ignored,
    };
    Some((lock, event))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: &[u8] = b"me";

    #[test]
    fn smoke() {
        assert_eq!(
            classify(b"__keyspace@0__:p:{k}", b"del", ME),
            Some((&b"p:{k}"[..], Event::Deleted))
        );
    }

    #[test]
    fn keyspace_events() {
        let ch = b"__keyspace@3__:p:{k}";
        let kind = |payload: &[u8]| classify(ch, payload, ME).map(|(_, e)| e);
        assert_eq!(kind(b"set"), Some(Event::Taken));
        assert_eq!(kind(b"expire"), Some(Event::Ignored));
        assert_eq!(kind(b"expired"), Some(Event::Freed));
        assert_eq!(kind(b"evicted"), Some(Event::Freed));
        assert_eq!(kind(b"rename_from"), Some(Event::Freed));
    }

    #[test]
    fn library_channel_events() {
        let ch = b"p:{k}:ev";
        let kind = |payload: &[u8]| classify(ch, payload, ME).map(|(_, e)| e);
        assert_eq!(kind(b"r"), Some(Event::Released));
        assert_eq!(kind(b"cother"), Some(Event::Contended));
        // Our own failed attempts are not contention.
        assert_eq!(kind(b"cme"), Some(Event::Ignored));
        assert_eq!(kind(b"?"), Some(Event::Ignored));
        assert_eq!(kind(b"gtok:12"), Some(Event::Granted));
        assert_eq!(kind(b"z"), Some(Event::Opened));
        let wake = Grant {
            nonce: 0,
            fence: 12,
            lease: Duration::ZERO,
        };
        assert_eq!(grant_of(b"gtok-1:12"), Some((&b"tok-1"[..], wake)));
        let granted = Grant {
            nonce: 7,
            fence: 12,
            lease: Duration::from_millis(1000),
        };
        assert_eq!(
            grant_of(b"gtok-1:7:12:1000"),
            Some((&b"tok-1"[..], granted))
        );
        assert_eq!(grant_of(b"gtok"), None);
        assert_eq!(grant_of(b"gtok:x"), None);
        assert_eq!(classify(ch, b"r", ME).map(|(l, _)| l), Some(&b"p:{k}"[..]));
    }

    #[test]
    fn other_channels_are_not_ours() {
        assert_eq!(classify(b"news", b"r", ME), None);
    }
}
