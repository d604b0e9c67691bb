//! What a panicking holder or waiter leaves behind, put right: the lock passed on or
//! released (by the cleanup thread), and the key usable again at once. (A read-write
//! lock's turns are put right in `turns`, with [`Engine::release_in_background`].)

use std::sync::Arc;

use crate::engine::state::Engine;
use crate::local::held::RemoteLock;
use crate::local::mailbox::{Grant, Slot};
use crate::proto::keys::Keys;

impl Engine {
    /// A release is unwinding after the table marked the key as releasing: stop renewals,
    /// leave the compare-and-delete to the cleanup thread, and let the next local waiter
    /// contend (`detached`: the table no longer knows this lock, and has nothing to do).
    pub(crate) fn abandon_release(&self, lock: &RemoteLock, detached: bool) {
        self.release_in_background(lock);
        if !detached {
            self.table.released(&lock.keys, false);
        }
    }

    /// Stops the renewals of `lock` (a lock or a shared hold) and leaves its
    /// compare-and-delete, on every node of its route, to the cleanup thread: a release
    /// that cannot be made now, or that may not have been made (a second one finds the
    /// token gone).
    pub(crate) fn release_in_background(&self, lock: &RemoteLock) {
        lock.begin_release(&self.counters);
        let route = self.topology.route(&lock.keys);
        self.cleanup.release_hold_later(lock, route.node_ids());
        self.look_again_at_turned(lock, &route);
    }

    /// A queued waiter is unwinding: leave the queue, and pass on whatever reached it
    /// meanwhile (the duty to contend, or the lock itself), so that the key stays usable.
    pub(crate) fn abandon_queued(self: &Arc<Self>, keys: &Keys, slot: &Slot) {
        match self.table.abandon(keys, slot) {
            None => {}
            Some(Grant::Contend { .. }) => self.table.contend_failed(keys),
            Some(Grant::Baton { remote, .. }) => self.abandon_baton(keys, &remote),
        }
    }

    /// A thread handed `remote` is unwinding before it returns it: let go (handed on, or
    /// released in Redis), so that the key stays usable.
    pub(crate) fn abandon_baton(self: &Arc<Self>, keys: &Keys, remote: &Arc<RemoteLock>) {
        if let Err(e) = self.release(remote) {
            log::warn!(
                "lock {:?}: release after a panic failed (it expires with its lease): {e}",
                keys.display()
            );
        }
    }
}
