//! The shared state of one thread cluster: channel sets, lost ranks, egress ports.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender, unbounded};

use crate::slices::window;
use crate::{CommError, LinkClass, LinkModel, Topology};

/// What a message belongs to; checked by the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    AllGather,
    AllToAll,
    AllToAllV,
    ReduceScatter,
    AllReduceScatter,
    AllReduceGather,
    Broadcast,
    Barrier,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::AllGather => "all_gather",
            Kind::AllToAll => "all_to_all",
            Kind::AllToAllV => "all_to_all_v",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::AllReduceScatter => "all_reduce (reduce-scatter phase)",
            Kind::AllReduceGather => "all_reduce (all-gather phase)",
            Kind::Broadcast => "broadcast",
            Kind::Barrier => "barrier",
        }
    }
}

/// A window into a shared, immutable buffer: one copy of the sender's data is
/// shared by every receiver.
#[derive(Debug, Clone)]
pub(crate) struct Payload {
    buf: Arc<[u8]>,
    start: usize,
    pub(crate) len: usize,
}

impl Payload {
    /// The window `[start, start + len)` of `buf`; checked here, by the sender.
    pub(crate) fn new(buf: Arc<[u8]>, start: usize, len: usize) -> Result<Self, CommError> {
        window(&buf, start, len, "send window")?;
        Ok(Self { buf, start, len })
    }

    /// The window's bytes.
    pub(crate) fn bytes(&self) -> Result<&[u8], CommError> {
        window(&self.buf, self.start, self.len, "received window")
    }
}

/// Which collective a message belongs to: its kind, the group's id and the
/// per-group sequence number (a receiver expects exactly this triple).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CallId {
    pub(crate) kind: Kind,
    pub(crate) group: u64,
    pub(crate) seq: u64,
}

/// The small header every message carries: the collective, and the length.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Header {
    pub(crate) id: CallId,
    pub(crate) len: usize,
}

/// One message on a per-pair channel.
#[derive(Debug)]
pub(crate) enum Msg {
    Data { header: Header, payload: Payload, deliver_at: Option<Instant> },
    Lost { reason: Arc<str> },
}

/// The channels of one communicator and its peers: one per ordered pair of ranks.
pub(crate) struct ChannelSet {
    /// `senders[src][dst]`.
    senders: Vec<Vec<Sender<Msg>>>,
    /// `receivers[dst]`: the inboxes of `dst`, indexed by `src`; taken once by `dst`.
    receivers: Mutex<Vec<Option<Vec<Receiver<Msg>>>>>,
    pub(crate) id: u64,
}

impl ChannelSet {
    fn new(world: usize, id: u64) -> Self {
        let mut senders: Vec<Vec<Sender<Msg>>> = (0..world).map(|_| Vec::with_capacity(world)).collect();
        let mut receivers: Vec<Vec<Receiver<Msg>>> = (0..world).map(|_| Vec::with_capacity(world)).collect();
        for row in senders.iter_mut() {
            for inbox in receivers.iter_mut() {
                let (tx, rx) = unbounded();
                row.push(tx);
                inbox.push(rx);
            }
        }
        Self { senders, receivers: Mutex::new(receivers.into_iter().map(Some).collect()), id }
    }

    pub(crate) fn send(&self, src: usize, dst: usize, msg: Msg) {
        if let Some(tx) = self.senders.get(src).and_then(|row| row.get(dst)) {
            // The fabric keeps every receiver alive, so this cannot fail; a message to a
            // rank that already exited is simply never read.
            let _ = tx.send(msg);
        }
    }

    pub(crate) fn take_inbox(&self, rank: usize) -> Option<Vec<Receiver<Msg>>> {
        lock(&self.receivers).get_mut(rank).and_then(Option::take)
    }
}

struct State {
    /// Channel sets by (parent set id, duplicate index); the root set is `(u64::MAX, 0)`.
    sets: HashMap<(u64, u64), Arc<ChannelSet>>,
    next_id: u64,
    /// Why each rank left, once it has.
    lost: Vec<Option<Arc<str>>>,
}

/// Shared by all ranks (and duplicated communicators) of one cluster run.
pub(crate) struct Fabric {
    pub(crate) topology: Topology,
    pub(crate) link_model: Option<LinkModel>,
    state: Mutex<State>,
    /// Egress port free times, `[intra, inter]` per rank (link model only).
    ports: Mutex<Vec<[Option<Instant>; 2]>>,
}

/// Locks ignoring poisoning: the protected data stays consistent under panics
/// (every critical section is a few plain assignments).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub(crate) const ROOT_SET: (u64, u64) = (u64::MAX, 0);

impl Fabric {
    pub(crate) fn new(topology: Topology, link_model: Option<LinkModel>) -> Self {
        let world = topology.world();
        Self {
            topology,
            link_model,
            state: Mutex::new(State { sets: HashMap::new(), next_id: 0, lost: vec![None; world] }),
            ports: Mutex::new(vec![[None, None]; world]),
        }
    }

    /// The channel set with key `key`, created on first request (by whichever rank
    /// arrives first). Ranks that are already lost get their `Lost` notice queued.
    pub(crate) fn channel_set(&self, key: (u64, u64)) -> Arc<ChannelSet> {
        let mut st = lock(&self.state);
        if let Some(set) = st.sets.get(&key) {
            return Arc::clone(set);
        }
        let id = st.next_id;
        st.next_id += 1;
        let set = Arc::new(ChannelSet::new(self.topology.world(), id));
        for (src, reason) in st.lost.iter().enumerate() {
            if let Some(reason) = reason {
                notify_lost(&set, self.topology.world(), src, reason);
            }
        }
        st.sets.insert(key, Arc::clone(&set));
        set
    }

    /// Marks `rank` as gone and tells every peer on every channel set. Messages the
    /// rank sent before are still delivered first (channels are FIFO).
    pub(crate) fn mark_lost(&self, rank: usize, reason: &str) {
        let mut st = lock(&self.state);
        let reason: Arc<str> = Arc::from(reason);
        if let Some(slot) = st.lost.get_mut(rank) {
            *slot = Some(Arc::clone(&reason));
        }
        for set in st.sets.values() {
            notify_lost(set, self.topology.world(), rank, &reason);
        }
    }

    /// Books a message of `bytes` from `src` to `dst` on the link model; returns the
    /// delivery instant (None without a model or for self-sends).
    pub(crate) fn book(&self, src: usize, dst: usize, bytes: usize) -> Option<Instant> {
        let model = self.link_model.as_ref()?;
        if src == dst {
            return None;
        }
        let class = LinkClass::between(&self.topology, src, dst);
        let idx = match class {
            LinkClass::IntraNode => 0,
            LinkClass::InterNode => 1,
        };
        let now = Instant::now();
        let mut ports = lock(&self.ports);
        let port = ports.get_mut(src)?.get_mut(idx)?;
        let start = port.map_or(now, |free| free.max(now));
        let finish = start + model.link(class).transfer_time(bytes);
        *port = Some(finish);
        Some(finish)
    }
}

fn notify_lost(set: &ChannelSet, world: usize, src: usize, reason: &Arc<str>) {
    for dst in (0..world).filter(|&d| d != src) {
        set.send(src, dst, Msg::Lost { reason: Arc::clone(reason) });
    }
}
