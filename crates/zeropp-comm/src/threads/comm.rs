//! [`ThreadComm`]: one rank's communicator in a [`super::ThreadCluster`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};

use super::fabric::{CallId, ChannelSet, Fabric, Header, Kind, Msg, Payload};
use crate::slices::{chunk, copy_to, window, window_mut};
use crate::{CommError, Communicator, Group, RawCall, Topology, TrafficCounter, check};

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

    /// Starts collective `kind` on `group`, where this rank is member `index` (the
    /// trait's provided methods validated the group): the next sequence number.
    fn begin(&mut self, group: &Group, kind: Kind, index: usize) -> Op {
        let gid = group_id(group);
        let seq = self.seqs.entry(gid).or_insert(0);
        let op = Op { kind, group: gid, seq: *seq, index };
        *seq += 1;
        op
    }

    fn send(&mut self, op: &Op, dst: usize, payload: Payload) {
        let deliver_at = self.fabric.book(self.rank, dst, payload.len);
        let id = CallId { kind: op.kind, group: op.group, seq: op.seq };
        let header = Header { id, len: payload.len };
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
        let got = header.id;
        if got != (CallId { kind: op.kind, group: op.group, seq: op.seq }) {
            let same_group = if got.group == op.group { "the same group" } else { "a different group" };
            return Err(CommError::Mismatch(format!(
                "rank {} expected {} #{} from rank {src} but received {} #{} on {same_group}: ranks called collectives in different orders",
                self.rank,
                op.kind.name(),
                op.seq,
                got.kind.name(),
                got.seq
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
        Ok(payload)
    }

    /// Sends window `ranges[j] = (start, len)` of `buf` to member `j`, for every
    /// other member (one range per member, in group order).
    fn scatter_out(
        &mut self,
        op: &Op,
        group: &Group,
        buf: &Arc<[u8]>,
        ranges: &[(usize, usize)],
    ) -> Result<(), CommError> {
        if ranges.len() != group.size() {
            return Err(CommError::Mismatch(format!(
                "{}: {} send windows for a group of {}",
                op.kind.name(),
                ranges.len(),
                group.size()
            )));
        }
        for (j, (&dst, &(start, len))) in group.ranks().iter().zip(ranges).enumerate() {
            if j != op.index {
                let payload = Payload::new(Arc::clone(buf), start, len)?;
                self.send(op, dst, payload);
            }
        }
        Ok(())
    }

    /// Sends all of `buf` to every other member.
    fn send_to_all(&mut self, op: &Op, group: &Group, buf: &Arc<[u8]>) -> Result<(), CommError> {
        self.scatter_out(op, group, buf, &vec![(0, buf.len()); group.size()])
    }

    /// Equal chunks of `chunk` bytes of `buf`, member `j` getting chunk `j`.
    fn scatter_chunks(
        &mut self,
        op: &Op,
        group: &Group,
        buf: &Arc<[u8]>,
        chunk: usize,
    ) -> Result<(), CommError> {
        let ranges: Vec<(usize, usize)> = (0..group.size()).map(|j| (j * chunk, chunk)).collect();
        self.scatter_out(op, group, buf, &ranges)
    }
}

/// Adds the native-endian `f32`s in `bytes` to `acc`, element by element.
fn sum_into(acc: &mut [f32], bytes: &[u8]) -> Result<(), CommError> {
    if bytes.len() != 4 * acc.len() {
        return Err(CommError::Mismatch(format!(
            "received {} bytes for a sum of {} floats",
            bytes.len(),
            acc.len()
        )));
    }
    for (a, b) in acc.iter_mut().zip(bytes.chunks_exact(4)) {
        *a += f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
    }
    Ok(())
}

/// Byte windows `(offset, len)` of consecutive chunks of `counts` bytes.
fn windows(counts: &[usize]) -> Vec<(usize, usize)> {
    let mut at = 0;
    counts
        .iter()
        .map(|&c| {
            let r = (at, c);
            at += c;
            r
        })
        .collect()
}

impl Communicator for ThreadComm {
    fn traffic(&self) -> &TrafficCounter {
        &self.traffic
    }

    fn traffic_mut(&mut self) -> &mut TrafficCounter {
        &mut self.traffic
    }

    fn duplicate(&mut self) -> Result<Box<dyn Communicator>, CommError> {
        Ok(Box::new(self.split_stream()?))
    }

    fn raw(&mut self, group: &Group, index: usize, call: RawCall<'_>) -> Result<(), CommError> {
        match call {
            RawCall::AllGather { send, recv } => {
                let c = send.len();
                let op = self.begin(group, Kind::AllGather, index);
                self.send_to_all(&op, group, &Arc::from(send))?;
                self.collect(&op, group, (send, c), |j, bytes| {
                    copy_to(recv, j * c, bytes, "all_gather: receive buffer")
                })
            }
            RawCall::AllToAll { send, recv } => {
                let counts = vec![send.len() / group.size(); group.size()];
                let op = self.begin(group, Kind::AllToAll, index);
                self.hook_all_to_all(&op, group, (send, &counts), (recv, &counts))
            }
            RawCall::AllToAllV { send, send_counts, recv, recv_counts } => {
                let op = self.begin(group, Kind::AllToAllV, index);
                self.hook_all_to_all(&op, group, (send, send_counts), (recv, recv_counts))
            }
            RawCall::ReduceScatter { send, recv } => self.hook_reduce_scatter(group, index, send, recv),
            RawCall::AllReduce { buf } => self.hook_all_reduce(group, index, buf),
            RawCall::Broadcast { root, buf } => {
                let root_rank = check::broadcast(group, root)?;
                let op = self.begin(group, Kind::Broadcast, index);
                if index == root {
                    let data: Arc<[u8]> = Arc::from(&*buf);
                    self.send_to_all(&op, group, &data)
                } else {
                    let p = self.recv(&op, root_rank, buf.len())?;
                    buf.copy_from_slice(p.bytes()?);
                    Ok(())
                }
            }
            RawCall::Barrier => {
                let op = self.begin(group, Kind::Barrier, index);
                let empty: Arc<[u8]> = Arc::from(&[][..]);
                self.send_to_all(&op, group, &empty)?;
                self.collect(&op, group, (&[], 0), |_, _| Ok(()))
            }
        }
    }
}

/// The algorithms behind [`RawCall`]s (arguments validated by the trait).
impl ThreadComm {
    /// Hands every member's `len` bytes to `take(j, bytes)`, in group order: the
    /// caller's own are `own`, the others' are received.
    fn collect(
        &mut self,
        op: &Op,
        group: &Group,
        (own, len): (&[u8], usize),
        mut take: impl FnMut(usize, &[u8]) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        for (j, &src) in group.ranks().iter().enumerate() {
            if j == op.index {
                take(j, own)?;
            } else {
                let p = self.recv(op, src, len)?;
                take(j, p.bytes()?)?;
            }
        }
        Ok(())
    }

    fn hook_reduce_scatter(
        &mut self,
        group: &Group,
        me: usize,
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), CommError> {
        let n = recv.len();
        let op = self.begin(group, Kind::ReduceScatter, me);
        let buf: Arc<[u8]> = Arc::from(bytemuck::cast_slice::<f32, u8>(send));
        self.scatter_chunks(&op, group, &buf, 4 * n)?;
        recv.fill(0.0);
        let own = chunk(&buf, me, 4 * n, "reduce_scatter: send buffer")?;
        self.collect(&op, group, (own, 4 * n), |_, bytes| sum_into(recv, bytes))
    }

    fn hook_all_reduce(&mut self, group: &Group, index: usize, buf: &mut [f32]) -> Result<(), CommError> {
        let g = group.size();
        let n = buf.len();
        let c = n.div_ceil(g);
        // Phase 1: reduce-scatter of chunks of c elements (the tail padded with zeros).
        let op = self.begin(group, Kind::AllReduceScatter, index);
        let padded: Arc<[u8]> = if c * g == n {
            Arc::from(bytemuck::cast_slice::<f32, u8>(buf))
        } else {
            let mut v = vec![0.0f32; c * g];
            copy_to(&mut v, 0, buf, "all_reduce: padded buffer")?;
            Arc::from(bytemuck::cast_slice::<f32, u8>(&v))
        };
        self.scatter_chunks(&op, group, &padded, 4 * c)?;
        let mut acc = vec![0.0f32; c];
        let own = chunk(&padded, index, 4 * c, "all_reduce: padded buffer")?;
        self.collect(&op, group, (own, 4 * c), |_, bytes| sum_into(&mut acc, bytes))?;
        // Phase 2: all-gather of the reduced chunks; chunk j lands on elements
        // [j·c, (j+1)·c) clipped to n (the padding is dropped).
        let op2 = self.begin(group, Kind::AllReduceGather, index);
        let mine: Arc<[u8]> = Arc::from(bytemuck::cast_slice::<f32, u8>(&acc));
        self.send_to_all(&op2, group, &mine)?;
        self.collect(&op2, group, (&mine, 4 * c), |j, bytes| {
            let lo = (j * c).min(n);
            let hi = ((j + 1) * c).min(n);
            let out = window_mut(buf, lo, hi - lo, "all_reduce: buffer")?;
            for (d, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
            }
            Ok(())
        })
    }

    /// Both all-to-alls: member `j` gets `send.1[j]` bytes of `send.0`, member `j`
    /// sends `recv.1[j]` bytes into `recv.0` (the caller validated the counts).
    fn hook_all_to_all(
        &mut self,
        op: &Op,
        group: &Group,
        (send, send_counts): (&[u8], &[usize]),
        (recv, recv_counts): (&mut [u8], &[usize]),
    ) -> Result<(), CommError> {
        let sr = windows(send_counts);
        let rr = windows(recv_counts);
        let buf: Arc<[u8]> = Arc::from(send);
        self.scatter_out(op, group, &buf, &sr)?;
        let what = format!("{}: receive buffer", op.kind.name());
        for (j, ((&src, &(s, sc)), &(at, rc))) in group.ranks().iter().zip(&sr).zip(&rr).enumerate() {
            if j == op.index {
                copy_to(recv, at, window(send, s, sc, "all_to_all: send buffer")?, &what)?;
            } else {
                let p = self.recv(op, src, rc)?;
                copy_to(recv, at, p.bytes()?, &what)?;
            }
        }
        Ok(())
    }
}
