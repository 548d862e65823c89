//! Traffic accounting: bytes and messages by link class and operation tag.
//!
//! Counters are *logical*: every backend records one message per peer and
//! collective with the payload it puts on the wire for that peer (quantized bytes,
//! scales and headers included), so the same collective gives the same figures on
//! every backend, whatever algorithm the backend uses underneath.

use std::collections::BTreeMap;

use crate::Topology;

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
    fn add(&mut self, other: &Self) {
        self.bytes_sent += other.bytes_sent;
        self.bytes_received += other.bytes_received;
        self.messages_sent += other.messages_sent;
        self.messages_received += other.messages_received;
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
        match class {
            LinkClass::IntraNode => &self.intra,
            LinkClass::InterNode => &self.inter,
        }
    }

    fn class_mut(&mut self, class: LinkClass) -> &mut LinkCounters {
        match class {
            LinkClass::IntraNode => &mut self.intra,
            LinkClass::InterNode => &mut self.inter,
        }
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
        let mut t = OpTraffic::default();
        for op in self.by_op.values() {
            t.intra.add(&op.intra);
            t.inter.add(&op.inter);
        }
        t
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
                let (a, b) = (op.class_mut(class), e.class(class));
                a.bytes_sent = a.bytes_sent.saturating_sub(b.bytes_sent);
                a.bytes_received = a.bytes_received.saturating_sub(b.bytes_received);
                a.messages_sent = a.messages_sent.saturating_sub(b.messages_sent);
                a.messages_received = a.messages_received.saturating_sub(b.messages_received);
            }
        }
        out
    }
}

/// The live counters of one communicator, with the current operation tag.
///
/// ```
/// use zeropp_comm::{Topology, TrafficCounter, LinkClass};
/// let t = Topology::new(4, 2)?;
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
}

/// The tag traffic is counted under until [`TrafficCounter::set_op`] is called.
pub const DEFAULT_OP: &str = "other";

impl TrafficCounter {
    /// Fresh counters for `rank`, tagged [`DEFAULT_OP`].
    pub fn new(topology: Topology, rank: usize) -> Self {
        Self { topology, rank, ops: vec![(DEFAULT_OP.to_string(), OpTraffic::default())], current: 0 }
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

    fn entry(&mut self, peer: usize) -> Option<&mut LinkCounters> {
        let class = LinkClass::between(&self.topology, self.rank, peer);
        self.ops.get_mut(self.current).map(|(_, op)| op.class_mut(class))
    }

    /// Records one message of `bytes` payload sent to `peer` (self-sends are not traffic).
    pub fn record_send(&mut self, peer: usize, bytes: usize) {
        if peer == self.rank {
            return;
        }
        if let Some(e) = self.entry(peer) {
            e.bytes_sent += bytes as u64;
            e.messages_sent += 1;
        }
    }

    /// Records one message of `bytes` payload received from `peer`.
    pub fn record_recv(&mut self, peer: usize, bytes: usize) {
        if peer == self.rank {
            return;
        }
        if let Some(e) = self.entry(peer) {
            e.bytes_received += bytes as u64;
            e.messages_received += 1;
        }
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

    /// Zeroes every counter (the current tag is kept).
    pub fn reset(&mut self) {
        for (_, op) in &mut self.ops {
            *op = OpTraffic::default();
        }
    }
}
