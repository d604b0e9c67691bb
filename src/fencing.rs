//! Fencing tokens: a Redis counter in the high bits, the local handoff number in the low.

/// Bits of a fencing token that number local handoffs (see [`LockGuard::fencing_token`]).
///
/// [`LockGuard::fencing_token`]: crate::LockGuard::fencing_token
pub(crate) const HANDOFF_BITS: u32 = 20;
/// The most consecutive local handoffs one remote acquisition can serve.
pub(crate) const MAX_LOCAL_SEQ: u32 = (1 << HANDOFF_BITS) - 1;

/// Fences above this would overflow the token's handoff bits.
pub(crate) const MAX_FENCE: u64 = u64::MAX >> HANDOFF_BITS;

/// The token of the `seq`-th local holder of the remote acquisition with fence `fence`.
pub(crate) fn token(fence: u64, seq: u32) -> u64 {
    (fence << HANDOFF_BITS) | u64::from(seq)
}
