//! Traffic accounting: bytes and messages by link class and operation tag.
//!
//! Counters are *logical*: every backend records one message per peer and
//! collective with the payload it puts on the wire for that peer (quantized bytes,
//! scales and headers included), so the same collective gives the same figures on
//! every backend, whatever algorithm the backend uses underneath.

use std::collections::BTreeMap;

use crate::{Group, Topology};

/// Which kind of link a message crosses, decided by the peer's node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LinkClass {
    /// Both ends on the same node.
    IntraNode,
    /// The ends on different nodes.
    InterNode,
}

impl LinkClass {
    /// The class of a message between `a` and `b`.
    pub fn between(topology: &Topology, a: usize, b: usize) -> Self {
        if topology.same_node(a, b) { Self::IntraNode } else { Self::InterNode }
    }

    /// `intra` or `inter`, whichever belongs to this class: the one accessor of
    /// every per-class pair (counters, links, byte predictions).
    ///
    /// ```
    /// use zeropp_comm::LinkClass;
    /// assert_eq!(LinkClass::InterNode.pick("intra", "inter"), "inter");
    /// ```
    pub fn pick<T>(self, intra: T, inter: T) -> T {
        match self {
            Self::IntraNode => intra,
            Self::InterNode => inter,
        }
    }
}

/// Bytes one rank sends per link class: the analytic prediction of a collective's
/// traffic (what [`LinkCounters::bytes_sent`] of each class will show).
///
/// ```
/// use zeropp_comm::{Group, LinkBytes, Topology};
/// let t = Topology::ranks(8).per_node(4)?;
/// // 100 bytes to every other rank of the world: 3 peers on the node, 4 on the other.
/// let b = LinkBytes::to_members(&t, 0, &Group::world(&t), 100);
/// assert_eq!(b, LinkBytes { intra: 300, inter: 400 });
/// assert_eq!((b + b).total(), 1400);
/// assert_eq!(b.scaled(2), b + b);
/// # Ok::<(), zeropp_comm::CommError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LinkBytes {
    /// Bytes sent to peers on the same node.
    pub intra: u64,
    /// Bytes sent to peers on other nodes.
    pub inter: u64,
}

impl LinkBytes {
    /// Adds `other` to these bytes.
    pub fn add(&mut self, other: LinkBytes) {
        *self += other;
    }

    /// Both classes multiplied by `k` (e.g. `k` calls of one collective).
    pub fn scaled(self, k: u64) -> Self {
        Self { intra: self.intra * k, inter: self.inter * k }
    }

    /// Intra-node plus inter-node bytes.
    pub fn total(self) -> u64 {
        self.intra + self.inter
    }

    /// The bytes `rank` sends when it sends `payload` bytes to each other member of
    /// `group` (itself excluded, whether or not it is a member), classed by
    /// [`LinkClass::between`].
    pub fn to_members(topology: &Topology, rank: usize, group: &Group, payload: u64) -> LinkBytes {
        let mut out = LinkBytes::default();
        for &peer in group.ranks().iter().filter(|&&p| p != rank) {
            *LinkClass::between(topology, rank, peer).pick(&mut out.intra, &mut out.inter) += payload;
        }
        out
    }
}

impl std::ops::Add for LinkBytes {
    type Output = LinkBytes;

    fn add(mut self, other: LinkBytes) -> LinkBytes {
        self += other;
        self
    }
}

impl std::ops::AddAssign for LinkBytes {
    fn add_assign(&mut self, other: LinkBytes) {
        self.intra += other.intra;
        self.inter += other.inter;
    }
}

/// Bytes and messages in both directions on one link class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkCounters {
    /// Payload bytes this rank sent.
    pub bytes_sent: u64,
    /// Payload bytes this rank received.
    pub bytes_received: u64,
    /// Messages this rank sent.
    pub messages_sent: u64,
    /// Messages this rank received.
    pub messages_received: u64,
}

impl LinkCounters {
    /// Adds `other`'s counters to these (e.g. to merge the counters of two
    /// communicators of one rank).
    ///
    /// ```
    /// use zeropp_comm::LinkCounters;
    /// let mut a = LinkCounters { bytes_sent: 10, messages_sent: 1, ..Default::default() };
    /// a.add(&LinkCounters { bytes_sent: 5, messages_sent: 2, ..Default::default() });
    /// assert_eq!((a.bytes_sent, a.messages_sent), (15, 3));
    /// ```
    pub fn add(&mut self, other: &Self) {
        *self = self.zip(other, |a, b| a + b);
    }

    /// Every counter of `self` combined with the same counter of `other` by `f`.
    fn zip(&self, other: &Self, f: impl Fn(u64, u64) -> u64) -> Self {
        Self {
            bytes_sent: f(self.bytes_sent, other.bytes_sent),
            bytes_received: f(self.bytes_received, other.bytes_received),
            messages_sent: f(self.messages_sent, other.messages_sent),
            messages_received: f(self.messages_received, other.messages_received),
        }
    }
}

/// Counters of one operation tag, split by link class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpTraffic {
    /// Traffic with peers on the same node.
    pub intra: LinkCounters,
    /// Traffic with peers on other nodes.
    pub inter: LinkCounters,
}

impl OpTraffic {
    /// The counters of one link class.
    pub fn class(&self, class: LinkClass) -> &LinkCounters {
        class.pick(&self.intra, &self.inter)
    }

    /// Adds `other`'s counters (both link classes) to these.
    pub fn add(&mut self, other: &Self) {
        self.intra.add(&other.intra);
        self.inter.add(&other.inter);
    }

    fn class_mut(&mut self, class: LinkClass) -> &mut LinkCounters {
        class.pick(&mut self.intra, &mut self.inter)
    }
}

/// A copy of the counters at one moment, keyed by operation tag.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrafficSnapshot {
    /// Counters per operation tag.
    pub by_op: BTreeMap<String, OpTraffic>,
}

impl TrafficSnapshot {
    /// The counters summed over all tags.
    pub fn total(&self) -> OpTraffic {
        self.by_op.values().fold(OpTraffic::default(), |mut t, op| {
            t.add(op);
            t
        })
    }

    /// Adds every tag's counters of `other` to this snapshot (tags missing here are
    /// inserted), e.g. to merge the counters of a rank's main and prefetch communicators.
    ///
    /// ```
    /// use zeropp_comm::{Topology, TrafficCounter};
    /// let t = Topology::ranks(4).per_node(2)?;
    /// let (mut a, mut b) = (TrafficCounter::new(t, 0), TrafficCounter::new(t, 0));
    /// a.set_op("gather");
    /// a.record_send(1, 100);
    /// b.set_op("gather");
    /// b.record_send(2, 30);
    /// b.set_op("reduce");
    /// b.record_send(3, 7);
    /// let mut s = a.snapshot();
    /// s.merge(&b.snapshot());
    /// assert_eq!(s.op("gather").intra.bytes_sent, 100);
    /// assert_eq!(s.op("gather").inter.bytes_sent, 30);
    /// assert_eq!(s.op("reduce").inter.messages_sent, 1);
    /// # Ok::<(), zeropp_comm::CommError>(())
    /// ```
    pub fn merge(&mut self, other: &TrafficSnapshot) {
        for (tag, op) in &other.by_op {
            self.by_op.entry(tag.clone()).or_default().add(op);
        }
    }

    /// The counters of one tag (zero when the tag never sent anything).
    pub fn op(&self, tag: &str) -> OpTraffic {
        self.by_op.get(tag).copied().unwrap_or_default()
    }

    /// `self - earlier`, tag by tag (saturating), e.g. the traffic of one step.
    pub fn since(&self, earlier: &TrafficSnapshot) -> TrafficSnapshot {
        let mut out = self.clone();
        for (tag, op) in out.by_op.iter_mut() {
            let e = earlier.op(tag);
            for class in [LinkClass::IntraNode, LinkClass::InterNode] {
                let a = op.class_mut(class);
                *a = a.zip(e.class(class), u64::saturating_sub);
            }
        }
        out
    }
}

/// The live counters of one communicator, with the current operation tag.
///
/// ```
/// use zeropp_comm::{Topology, TrafficCounter, LinkClass};
/// let t = Topology::ranks(4).per_node(2)?;
/// let mut c = TrafficCounter::new(t, 0);
/// c.set_op("fwd_gather");
/// c.record_send(1, 100); // same node
/// c.record_send(2, 50); // other node
/// let s = c.snapshot();
/// assert_eq!(s.op("fwd_gather").intra.bytes_sent, 100);
/// assert_eq!(s.total().inter.bytes_sent, 50);
/// # Ok::<(), zeropp_comm::CommError>(())
/// ```
#[derive(Debug, Clone)]
pub struct TrafficCounter {
    topology: Topology,
    rank: usize,
    /// One entry per tag seen since the last reset; `current` indexes the active one.
    ops: Vec<(String, OpTraffic)>,
    current: usize,
    /// Time the collectives spent in quantization kernels on this communicator's
    /// thread (not traffic: kept out of snapshots, which backends compare bitwise).
    quant_time: std::time::Duration,
}

/// The tag traffic is counted under until [`TrafficCounter::set_op`] is called.
pub const DEFAULT_OP: &str = "other";

impl TrafficCounter {
    /// Fresh counters for `rank`, tagged [`DEFAULT_OP`].
    pub fn new(topology: Topology, rank: usize) -> Self {
        Self {
            topology,
            rank,
            ops: vec![(DEFAULT_OP.to_string(), OpTraffic::default())],
            current: 0,
            quant_time: std::time::Duration::ZERO,
        }
    }

    /// The rank these counters belong to.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The topology that classes each peer's link.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Labels the traffic that follows (e.g. `fwd_gather`, `bwd_gather`, `grad_reduce`).
    pub fn set_op(&mut self, tag: &str) {
        if let Some(i) = self.ops.iter().position(|(t, _)| t == tag) {
            self.current = i;
        } else {
            self.ops.push((tag.to_string(), OpTraffic::default()));
            self.current = self.ops.len() - 1;
        }
    }

    /// The current operation tag.
    pub fn op(&self) -> &str {
        self.ops.get(self.current).map_or(DEFAULT_OP, |(t, _)| t.as_str())
    }

    /// Adds one message of `bytes` to the pair of counters `pick` chooses (bytes,
    /// messages) of `peer`'s link class; self-sends are not traffic.
    fn record(&mut self, peer: usize, bytes: usize, pick: fn(&mut LinkCounters) -> (&mut u64, &mut u64)) {
        if peer == self.rank {
            return;
        }
        let class = LinkClass::between(&self.topology, self.rank, peer);
        if let Some((_, op)) = self.ops.get_mut(self.current) {
            let (b, m) = pick(op.class_mut(class));
            *b += bytes as u64;
            *m += 1;
        }
    }

    /// Records one message of `bytes` payload sent to `peer` (self-sends are not traffic).
    pub fn record_send(&mut self, peer: usize, bytes: usize) {
        self.record(peer, bytes, |c| (&mut c.bytes_sent, &mut c.messages_sent));
    }

    /// Records one message of `bytes` payload received from `peer`.
    pub fn record_recv(&mut self, peer: usize, bytes: usize) {
        self.record(peer, bytes, |c| (&mut c.bytes_received, &mut c.messages_received));
    }

    /// A copy of the counters now (tags that carried nothing are left out).
    pub fn snapshot(&self) -> TrafficSnapshot {
        let by_op = self
            .ops
            .iter()
            .filter(|(_, op)| *op != OpTraffic::default())
            .map(|(t, op)| (t.clone(), *op))
            .collect();
        TrafficSnapshot { by_op }
    }

    /// Adds `dt` to the time spent quantizing and dequantizing (the collectives
    /// call this around their quantization kernels).
    pub fn add_quant_time(&mut self, dt: std::time::Duration) {
        self.quant_time += dt;
    }

    /// The time the collectives on this communicator have spent in quantization
    /// kernels (quantize, dequantize, the fused reduce) since it was made; a
    /// caller timing a step takes the difference. [`reset`](Self::reset) keeps it.
    ///
    /// ```
    /// use zeropp_comm::{Topology, TrafficCounter};
    /// use std::time::Duration;
    /// let mut c = TrafficCounter::new(Topology::ranks(2).per_node(2)?, 0);
    /// c.add_quant_time(Duration::from_millis(3));
    /// assert_eq!(c.quant_time(), Duration::from_millis(3));
    /// # Ok::<(), zeropp_comm::CommError>(())
    /// ```
    pub fn quant_time(&self) -> std::time::Duration {
        self.quant_time
    }

    /// Zeroes every counter (the current tag is kept).
    pub fn reset(&mut self) {
        for (_, op) in &mut self.ops {
            *op = OpTraffic::default();
        }
    }
}
