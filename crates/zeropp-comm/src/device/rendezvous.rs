//! The meeting point of the one-device cluster's collectives.
//!
//! A collective of a group is one *slot*, keyed by the communicator (duplicates
//! get their own), the group's ranks and the group's sequence number on that
//! communicator. Every member posts (phase 1) its buffers with a *ready* event and
//! waits for all posts; each then runs its reads on its own stream and posts a
//! *done* event (phase 2), and waits for all of those before it returns, so no
//! buffer is reused while a peer may still read it. A member whose thread ended
//! (returned or panicked) is marked lost: waiting on it fails with
//! [`CommError::PeerLost`] at once; a silent member with [`CommError::Timeout`].

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::{Device, DeviceBuf};
use crate::{CommError, Primitive};

/// What one member posts for a collective.
pub(super) struct Post<D: Device> {
    pub(super) kind: Primitive,
    /// The primitive's main byte count (send bytes; `buf` bytes for in-place calls).
    pub(super) bytes: usize,
    /// All-to-all-v send counts (empty otherwise).
    pub(super) counts: Vec<usize>,
    /// Broadcast root index (0 otherwise).
    pub(super) root: usize,
    /// The buffer peers read from, with its window.
    pub(super) buf: Option<(DeviceBuf<D>, usize, usize)>,
    /// Recorded after the poster's earlier work on its stream.
    pub(super) ready: Option<D::Event>,
    /// Per member (group order): when this poster's message to it arrives under the
    /// link model (None: no model, or nothing sent).
    pub(super) arrive: Vec<Option<Instant>>,
}

pub(super) type Key = (Vec<u32>, Vec<usize>, u64);

struct Slot<D: Device> {
    posts: Vec<Option<Arc<Post<D>>>>,
    done: Vec<Option<Option<Arc<D::Event>>>>,
    released: usize,
}

struct State<D: Device> {
    slots: HashMap<Key, Slot<D>>,
    lost: Vec<Option<String>>,
}

/// The shared rendezvous of one [`super::DeviceCluster::run`].
pub(super) struct Rendezvous<D: Device> {
    state: Mutex<State<D>>,
    cv: Condvar,
    timeout: Duration,
}

impl<D: Device> Rendezvous<D> {
    pub(super) fn new(world: usize, timeout: Duration) -> Self {
        Self {
            state: Mutex::new(State { slots: HashMap::new(), lost: vec![None; world] }),
            cv: Condvar::new(),
            timeout,
        }
    }

    /// Marks `rank` as gone and wakes every waiter.
    pub(super) fn mark_lost(&self, rank: usize, reason: &str) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(l) = st.lost.get_mut(rank) {
            l.get_or_insert_with(|| reason.to_string());
        }
        drop(st);
        self.cv.notify_all();
    }

    /// Waits until `ready(slot)` holds; fails when a member `missing(slot)` names is lost.
    fn wait_for(
        &self,
        key: &Key,
        op: Primitive,
        mut ready: impl FnMut(&Slot<D>) -> Option<usize>,
    ) -> Result<std::sync::MutexGuard<'_, State<D>>, CommError> {
        let deadline = Instant::now() + self.timeout;
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            let missing = match st.slots.get(key) {
                Some(slot) => ready(slot),
                None => return Err(CommError::Mismatch(format!("{op}: collective slot vanished"))),
            };
            let Some(idx) = missing else { return Ok(st) };
            let rank = key.1.get(idx).copied().unwrap_or(usize::MAX);
            if let Some(Some(reason)) = st.lost.get(rank) {
                return Err(CommError::PeerLost { rank, reason: reason.clone() });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout { rank, op: op.to_string(), after: self.timeout });
            }
            st = self.cv.wait_timeout(st, deadline - now).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// Runs `put` on the slot of `key` (made empty for its group if new), then
    /// wakes every waiter.
    fn deposit(&self, key: &Key, put: impl FnOnce(&mut Slot<D>)) {
        let g = key.1.len();
        {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            let slot = st.slots.entry(key.clone()).or_insert_with(|| Slot {
                posts: vec![None; g],
                done: vec![None; g],
                released: 0,
            });
            put(slot);
        }
        self.cv.notify_all();
    }

    /// Phase 1: posts member `index`'s post and returns every member's, in group order.
    pub(super) fn post(
        &self,
        key: &Key,
        index: usize,
        post: Post<D>,
    ) -> Result<Vec<Arc<Post<D>>>, CommError> {
        let op = post.kind;
        self.deposit(key, |slot| {
            if let Some(p) = slot.posts.get_mut(index) {
                *p = Some(Arc::new(post));
            }
        });
        let st = self.wait_for(key, op, |s| s.posts.iter().position(Option::is_none))?;
        let posts =
            st.slots.get(key).map(|s| s.posts.iter().flatten().cloned().collect()).unwrap_or_default();
        Ok(posts)
    }

    /// Phase 2: member `index` is done reading (its reads are before `done` on its
    /// stream); waits for every member and returns their events.
    pub(super) fn finish(
        &self,
        key: &Key,
        index: usize,
        op: Primitive,
        done: Option<D::Event>,
    ) -> Result<Vec<Arc<D::Event>>, CommError> {
        self.deposit(key, |slot| {
            if let Some(d) = slot.done.get_mut(index) {
                *d = Some(done.map(Arc::new));
            }
        });
        // On failure (a lost peer) the slot stays: the cluster's run is ending.
        let mut st = self.wait_for(key, op, |s| s.done.iter().position(Option::is_none))?;
        let events = st
            .slots
            .get(key)
            .map(|s| s.done.iter().flatten().flatten().cloned().collect())
            .unwrap_or_default();
        if let Some(slot) = st.slots.get_mut(key) {
            slot.released += 1;
            if slot.released >= key.1.len() {
                st.slots.remove(key);
            }
        }
        Ok(events)
    }
}
