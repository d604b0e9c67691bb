//! Fencing tokens: a Redis counter in the high bits, the local handoff number in the low.
//!
//! The counter starts at the server's clock in microseconds (see `proto::scripts`'s
//! `FENCE_FN`), about 2^51 today, so it gets 52 bits (up to the year 2112, and Lua's
//! doubles are exact to 2^53); the low 12 bits number local handoffs.

/// Bits of a fencing token that number local handoffs (see [`LockGuard::fencing_token`]).
///
/// [`LockGuard::fencing_token`]: crate::LockGuard::fencing_token
pub(crate) const HANDOFF_BITS: u32 = 12;
/// The most consecutive local handoffs one remote acquisition can serve (4,095).
pub(crate) const MAX_LOCAL_SEQ: u32 = (1 << HANDOFF_BITS) - 1;

/// Fences above this would overflow the token's handoff bits (2^52 − 1).
pub(crate) const MAX_FENCE: u64 = u64::MAX >> HANDOFF_BITS;

/// The token of the `seq`-th local holder of the remote acquisition with fence `fence`.
pub(crate) fn token(fence: u64, seq: u32) -> u64 {
    (fence << HANDOFF_BITS) | u64::from(seq)
}
