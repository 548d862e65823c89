//! [`ThreadComm`]: one rank's communicator in a [`super::ThreadCluster`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};

use super::fabric::{ChannelSet, Fabric, Header, Kind, Msg, Payload};
use crate::{CommError, Communicator, Group, Topology, TrafficCounter};

/// One rank's communicator of the thread backend.
///
/// Messages travel over one unbounded crossbeam channel per ordered pair of ranks
/// (per channel set: [`Communicator::duplicate`] creates a new set), so sends never
/// block and receives block with a deadline (no spinning). Every message carries a
/// header (collective kind, group id, per-group sequence number, length) that the
/// receiver checks: ranks that disagree on the order, kind or sizes of collectives
/// get [`CommError::Mismatch`]. A rank whose closure panicked or returned is
/// announced to all peers, whose pending receive from it fails with
/// [`CommError::PeerLost`]; a peer silent for longer than the timeout gives
/// [`CommError::Timeout`].
pub struct ThreadComm {
    rank: usize,
    topology: Topology,
    fabric: Arc<Fabric>,
    set: Arc<ChannelSet>,
    inbox: Vec<Receiver<Msg>>,
    traffic: TrafficCounter,
    seqs: HashMap<u64, u64>,
    dups: u64,
    timeout: Duration,
}

/// One collective in progress on this rank.
struct Op {
    kind: Kind,
    group: u64,
    seq: u64,
    index: usize,
}

fn group_id(group: &Group) -> u64 {
    // FNV-1a over the member list: equal groups have equal ids on every rank.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &r in group.ranks() {
        for b in (r as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h ^ group.size() as u64
}

impl ThreadComm {
    pub(crate) fn new(
        rank: usize,
        fabric: Arc<Fabric>,
        key: (u64, u64),
        timeout: Duration,
    ) -> Result<Self, CommError> {
        let set = fabric.channel_set(key);
        let inbox = set.take_inbox(rank).ok_or_else(|| {
            CommError::InvalidConfig(format!(
                "rank {rank} already holds a communicator on channel set {key:?}"
            ))
        })?;
        let topology = fabric.topology;
        Ok(Self {
            rank,
            topology,
            fabric,
            set,
            inbox,
            traffic: TrafficCounter::new(topology, rank),
            seqs: HashMap::new(),
            dups: 0,
            timeout,
        })
    }

    /// Like [`Communicator::duplicate`], but keeps the concrete type: an independent
    /// channel set (a second stream) on the same ranks, with fresh traffic counters.
    /// Collective: every rank must call it, in the same order.
    pub fn split_stream(&mut self) -> Result<ThreadComm, CommError> {
        let key = (self.set.id, self.dups);
        self.dups += 1;
        ThreadComm::new(self.rank, Arc::clone(&self.fabric), key, self.timeout)
    }

    /// This rank (also available through [`Communicator::rank`]).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The job's topology (also available through [`Communicator::topology`]).
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The receive timeout of this communicator.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn begin(&mut self, group: &Group, kind: Kind) -> Result<Op, CommError> {
        if let Some(&r) = group.ranks().iter().find(|&&r| r >= self.topology.world()) {
            return Err(CommError::InvalidGroup(format!(
                "rank {r} is outside a world of {}",
                self.topology.world()
            )));
        }
        let index = group.index_of(self.rank).ok_or_else(|| {
            CommError::InvalidGroup(format!(
                "rank {} called {} on group {:?} without being a member",
                self.rank,
                kind.name(),
                group.ranks()
            ))
        })?;
        let gid = group_id(group);
        let seq = self.seqs.entry(gid).or_insert(0);
        let op = Op { kind, group: gid, seq: *seq, index };
        *seq += 1;
        Ok(op)
    }

    fn send(&mut self, op: &Op, dst: usize, payload: Payload) {
        self.traffic.record_send(dst, payload.len);
        let deliver_at = self.fabric.book(self.rank, dst, payload.len);
        let header = Header { kind: op.kind, group: op.group, seq: op.seq, len: payload.len };
        self.set.send(self.rank, dst, Msg::Data { header, payload, deliver_at });
    }

    fn recv(&mut self, op: &Op, src: usize, expected_len: usize) -> Result<Payload, CommError> {
        let rx = self
            .inbox
            .get(src)
            .ok_or_else(|| CommError::InvalidGroup(format!("rank {src} is outside the world")))?;
        let msg = match rx.recv_timeout(self.timeout) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => {
                return Err(CommError::Timeout {
                    rank: src,
                    op: op.kind.name().to_string(),
                    after: self.timeout,
                });
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(CommError::PeerLost { rank: src, reason: "its channel closed".into() });
            }
        };
        let (header, payload, deliver_at) = match msg {
            Msg::Lost { reason } => {
                return Err(CommError::PeerLost {
                    rank: src,
                    reason: format!("{reason} (while rank {} waited in {})", self.rank, op.kind.name()),
                });
            }
            Msg::Data { header, payload, deliver_at } => (header, payload, deliver_at),
        };
        if header.kind != op.kind || header.group != op.group || header.seq != op.seq {
            let same_group = if header.group == op.group { "the same group" } else { "a different group" };
            return Err(CommError::Mismatch(format!(
                "rank {} expected {} #{} from rank {src} but received {} #{} on {same_group}: ranks called collectives in different orders",
                self.rank,
                op.kind.name(),
                op.seq,
                header.kind.name(),
                header.seq
            )));
        }
        if header.len != expected_len {
            return Err(CommError::Mismatch(format!(
                "rank {src} sent {} bytes to rank {} in {} #{} but {expected_len} were expected",
                header.len,
                self.rank,
                op.kind.name(),
                op.seq
            )));
        }
        if let Some(at) = deliver_at {
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
        }
        self.traffic.record_recv(src, payload.len);
        Ok(payload)
    }

    /// Sends `bytes[chunk j]` to member `j` for every other member; `ranges` gives the
    /// byte range of each member's chunk in `buf`.
    fn scatter_out(&mut self, op: &Op, group: &Group, buf: &Arc<[u8]>, ranges: &[(usize, usize)]) {
        for (j, &dst) in group.ranks().iter().enumerate() {
            if j == op.index {
                continue;
            }
            let (start, len) = ranges.get(j).copied().unwrap_or((0, 0));
            self.send(op, dst, Payload { buf: Arc::clone(buf), start, len });
        }
    }
}

fn sum_into(acc: &mut [f32], bytes: &[u8]) {
    for (a, b) in acc.iter_mut().zip(bytes.chunks_exact(4)) {
        *a += f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
    }
}

fn copy_into(dst: &mut [u8], at: usize, src: &[u8]) -> Result<(), CommError> {
    dst.get_mut(at..at + src.len())
        .ok_or_else(|| CommError::Mismatch("receive buffer too small".into()))?
        .copy_from_slice(src);
    Ok(())
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn topology(&self) -> &Topology {
        &self.topology
    }

    fn traffic(&self) -> &TrafficCounter {
        &self.traffic
    }

    fn traffic_mut(&mut self) -> &mut TrafficCounter {
        &mut self.traffic
    }

    fn all_gather_bytes(&mut self, group: &Group, send: &[u8], recv: &mut [u8]) -> Result<(), CommError> {
        let g = group.size();
        let c = send.len();
        if recv.len() != c * g {
            return Err(CommError::Mismatch(format!(
                "all_gather: receive buffer of {} bytes for {g} chunks of {c} bytes",
                recv.len()
            )));
        }
        let op = self.begin(group, Kind::AllGather)?;
        let buf: Arc<[u8]> = Arc::from(send);
        self.scatter_out(&op, group, &buf, &vec![(0, c); g]);
        copy_into(recv, op.index * c, send)?;
        for (j, &src) in group.ranks().iter().enumerate() {
            if j != op.index {
                let p = self.recv(&op, src, c)?;
                copy_into(recv, j * c, p.bytes())?;
            }
        }
        Ok(())
    }

    fn all_to_all_bytes(&mut self, group: &Group, send: &[u8], recv: &mut [u8]) -> Result<(), CommError> {
        let g = group.size();
        if send.len() != recv.len() || !send.len().is_multiple_of(g) {
            return Err(CommError::Mismatch(format!(
                "all_to_all: send {} and receive {} bytes must be equal multiples of the group size {g}",
                send.len(),
                recv.len()
            )));
        }
        let c = send.len() / g;
        let counts = vec![c; g];
        self.all_to_all_generic(group, Kind::AllToAll, send, &counts, recv, &counts)
    }

    fn all_to_all_v_bytes(
        &mut self,
        group: &Group,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let g = group.size();
        if send_counts.len() != g || recv_counts.len() != g {
            return Err(CommError::Mismatch(format!(
                "all_to_all_v: {} send and {} receive counts for a group of {g}",
                send_counts.len(),
                recv_counts.len()
            )));
        }
        if send_counts.iter().sum::<usize>() != send.len() || recv_counts.iter().sum::<usize>() != recv.len()
        {
            return Err(CommError::Mismatch(
                "all_to_all_v: counts do not add up to the buffer lengths".into(),
            ));
        }
        self.all_to_all_generic(group, Kind::AllToAllV, send, send_counts, recv, recv_counts)
    }

    fn reduce_scatter_f32(&mut self, group: &Group, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let g = group.size();
        let n = recv.len();
        if send.len() != n * g {
            return Err(CommError::Mismatch(format!(
                "reduce_scatter: send of {} elements for {g} chunks of {n}",
                send.len()
            )));
        }
        let op = self.begin(group, Kind::ReduceScatter)?;
        let buf: Arc<[u8]> = Arc::from(bytemuck::cast_slice::<f32, u8>(send));
        let ranges: Vec<(usize, usize)> = (0..g).map(|j| (j * n * 4, n * 4)).collect();
        self.scatter_out(&op, group, &buf, &ranges);
        recv.fill(0.0);
        for (j, &src) in group.ranks().iter().enumerate() {
            if j == op.index {
                let own = send.get(j * n..(j + 1) * n).unwrap_or(&[]);
                recv.iter_mut().zip(own).for_each(|(a, b)| *a += b);
            } else {
                let p = self.recv(&op, src, n * 4)?;
                sum_into(recv, p.bytes());
            }
        }
        Ok(())
    }

    fn all_reduce_f32(&mut self, group: &Group, buf: &mut [f32]) -> Result<(), CommError> {
        let g = group.size();
        let n = buf.len();
        let c = n.div_ceil(g);
        // Phase 1: reduce-scatter of chunks of c elements (the tail padded with zeros).
        let op = self.begin(group, Kind::AllReduceScatter)?;
        let padded: Arc<[u8]> = if c * g == n {
            Arc::from(bytemuck::cast_slice::<f32, u8>(buf))
        } else {
            let mut v = vec![0.0f32; c * g];
            v.get_mut(..n).unwrap_or(&mut []).copy_from_slice(buf);
            Arc::from(bytemuck::cast_slice::<f32, u8>(&v))
        };
        let ranges: Vec<(usize, usize)> = (0..g).map(|j| (j * c * 4, c * 4)).collect();
        self.scatter_out(&op, group, &padded, &ranges);
        let mut acc = vec![0.0f32; c];
        for (j, &src) in group.ranks().iter().enumerate() {
            if j == op.index {
                let own = padded.get(j * c * 4..(j + 1) * c * 4).unwrap_or(&[]);
                sum_into(&mut acc, own);
            } else {
                let p = self.recv(&op, src, c * 4)?;
                sum_into(&mut acc, p.bytes());
            }
        }
        // Phase 2: all-gather of the reduced chunks.
        let op2 = self.begin(group, Kind::AllReduceGather)?;
        let mine: Arc<[u8]> = Arc::from(bytemuck::cast_slice::<f32, u8>(&acc));
        self.scatter_out(&op2, group, &mine, &vec![(0, c * 4); g]);
        let place = |buf: &mut [f32], j: usize, bytes: &[u8]| {
            let lo = (j * c).min(n);
            let hi = ((j + 1) * c).min(n);
            for (d, b) in buf.get_mut(lo..hi).unwrap_or(&mut []).iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
            }
        };
        place(buf, op2.index, &mine);
        for (j, &src) in group.ranks().iter().enumerate() {
            if j != op2.index {
                let p = self.recv(&op2, src, c * 4)?;
                place(buf, j, p.bytes());
            }
        }
        Ok(())
    }

    fn broadcast_bytes(&mut self, group: &Group, root: usize, buf: &mut [u8]) -> Result<(), CommError> {
        let root_rank = group.rank_at(root).ok_or_else(|| {
            CommError::InvalidGroup(format!("broadcast root index {root} in a group of {}", group.size()))
        })?;
        let op = self.begin(group, Kind::Broadcast)?;
        if op.index == root {
            let data: Arc<[u8]> = Arc::from(&*buf);
            self.scatter_out(&op, group, &data, &vec![(0, buf.len()); group.size()]);
        } else {
            let p = self.recv(&op, root_rank, buf.len())?;
            buf.copy_from_slice(p.bytes());
        }
        Ok(())
    }

    fn barrier(&mut self, group: &Group) -> Result<(), CommError> {
        let op = self.begin(group, Kind::Barrier)?;
        let empty: Arc<[u8]> = Arc::from(&[][..]);
        self.scatter_out(&op, group, &empty, &vec![(0, 0); group.size()]);
        for (j, &src) in group.ranks().iter().enumerate() {
            if j != op.index {
                self.recv(&op, src, 0)?;
            }
        }
        Ok(())
    }

    fn duplicate(&mut self) -> Result<Box<dyn Communicator>, CommError> {
        Ok(Box::new(self.split_stream()?))
    }
}

impl ThreadComm {
    fn all_to_all_generic(
        &mut self,
        group: &Group,
        kind: Kind,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let op = self.begin(group, kind)?;
        let me = op.index;
        if send_counts.get(me) != recv_counts.get(me) {
            return Err(CommError::Mismatch(format!(
                "{}: this rank sends itself {:?} bytes but expects {:?}",
                kind.name(),
                send_counts.get(me),
                recv_counts.get(me)
            )));
        }
        let offsets = |counts: &[usize]| -> Vec<(usize, usize)> {
            let mut at = 0;
            counts
                .iter()
                .map(|&c| {
                    let r = (at, c);
                    at += c;
                    r
                })
                .collect()
        };
        let sr = offsets(send_counts);
        let rr = offsets(recv_counts);
        let buf: Arc<[u8]> = Arc::from(send);
        self.scatter_out(&op, group, &buf, &sr);
        if let (Some(&(s, c)), Some(&(r, _))) = (sr.get(me), rr.get(me)) {
            copy_into(recv, r, send.get(s..s + c).unwrap_or(&[]))?;
        }
        for (j, &src) in group.ranks().iter().enumerate() {
            if j != me {
                let (at, c) = rr.get(j).copied().unwrap_or((0, 0));
                let p = self.recv(&op, src, c)?;
                copy_into(recv, at, p.bytes())?;
            }
        }
        Ok(())
    }
}
