//! qwZ-Δ: the hpZ copy kept current by quantized weight **differences**
//! (SDP4Bit's weight-difference quantization, on top of ZeRO++'s hpZ).
//!
//! With hpZ, every hpZ group (`H` consecutive ranks of a node) holds the whole
//! layer, sharded over its members: member `i` holds primary shards
//! `i·W/H .. (i+1)·W/H` (the secondary shards concatenate the primaries in rank
//! order). After an optimizer step the holders' copies are stale. Instead of
//! gathering the new weights across nodes again, each owner `r` keeps `Ŵ_r`, the
//! reconstruction every holder has of its shard, and sends only `Q(W_r − Ŵ_r)`
//! (INT4 by default, per-group scales); sender and holders then both set
//! `Ŵ_r ← round(Ŵ_r + Deq(Q(W_r − Ŵ_r)))` with the same arithmetic
//! ([`delta_encode`] on the owner, [`delta_apply`] on each holder), so they stay
//! bit-identical, and what the quantization (or the rounding to the copy's
//! element type) loses is part of the next difference: the error never
//! accumulates.
//!
//! [`qwz_delta_exchange`] delivers the encodings. Hop 1, an all-to-all-v over
//! the world: owner `r` (holder index `h = r / (W/H)`) sends its encoding to the
//! holder of index `h` in every hpZ group of its own node, and to the holder of
//! index `h` in the *first* hpZ group of every other node (`N − 1` messages
//! across nodes, the only cross-node bytes). Hop 2, only when a node has more
//! than one hpZ group (`H < L`) and there is more than one node: each first-group
//! holder forwards what it received from other nodes to the holders of its index
//! in the node's other groups, inside the node.
//!
//! Bytes per rank ([`qwz_delta_bytes`], with `E` the encoding of one shard):
//! `E` to each other hop-1 target (`L/H` in the node, less itself, and `N − 1`
//! across nodes), plus, for a first-group holder, `E` per encoding from other
//! nodes to each of the `L/H − 1` other groups' holders.

use zeropp_quant::{Element, Options, QuantSpec, QuantizedRef, dequantize_into, quantize_to_wire};

use super::QuantClock;
use crate::{CommError, Communicator, Group, LinkBytes, LinkClass, Topology};

/// Options of the difference encodings: the format (symmetric INT4, groups of
/// [`super::DEFAULT_GROUP_SIZE`], by default) and the kernel options (rounding:
/// nearest by default; the differences carry their own error feedback).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeltaOptions {
    /// The format of `Q(W − Ŵ)`.
    pub spec: QuantSpec,
    /// Kernel options (rounding, threading).
    pub quant: Options,
}

impl Default for DeltaOptions {
    fn default() -> Self {
        let spec = QuantSpec::int4(super::DEFAULT_GROUP_SIZE)
            .unwrap_or_else(|_| unreachable!("a non-zero group size is valid"));
        Self { spec, quant: Options::default() }
    }
}

/// Checks that `hpz` divides the node size.
fn check_hpz(t: &Topology, hpz: usize) -> Result<(), CommError> {
    if hpz == 0 || !t.local_size().is_multiple_of(hpz) {
        return Err(CommError::InvalidGroup(format!(
            "qwz delta: hpZ groups of {hpz} ranks do not divide nodes of {} ranks",
            t.local_size()
        )));
    }
    Ok(())
}

/// The holder index of owner `r`'s shard: member `r / (W/H)` of every hpZ group.
fn holder_index(t: &Topology, hpz: usize, r: usize) -> usize {
    r / (t.world() / hpz)
}

/// Whether `to` receives owner `from`'s encoding in hop 1.
fn hop1_target(t: &Topology, hpz: usize, from: usize, to: usize) -> bool {
    let (l, h) = (t.local_rank(to), holder_index(t, hpz, from));
    l % hpz == h && (t.same_node(from, to) || l < hpz)
}

/// The ranks of `rank`'s node that a first-group holder forwards to in hop 2
/// (the holders of its index in the node's other groups), and the owners whose
/// encodings it forwards (those of other nodes whose shards it holds).
fn hop2(t: &Topology, hpz: usize, rank: usize) -> (Vec<usize>, Vec<usize>) {
    let (m, l) = (t.node_of(rank), t.local_rank(rank));
    if l >= hpz || t.nodes() == 1 {
        return (Vec::new(), Vec::new());
    }
    let to = (1..t.local_size() / hpz).map(|g| t.rank_of(m, g * hpz + l)).collect();
    let from = owners_of(t, hpz, l).filter(|&r| t.node_of(r) != m).collect();
    (to, from)
}

/// The owners of the shards a holder of index `h` holds, in order.
fn owners_of(t: &Topology, hpz: usize, h: usize) -> impl Iterator<Item = usize> {
    let per = t.world() / hpz;
    h * per..(h + 1) * per
}

/// qwZ-Δ's routing for one rank: the one description of the exchange that the
/// host ([`qwz_delta_exchange`]) and the device
/// ([`crate::device::collectives::qwz_delta_exchange`]) both execute, so they
/// route (and count) the same bytes.
#[derive(Debug, Clone)]
pub(crate) struct DeltaRoute {
    /// Hop 1 over the world: whether this rank sends its encoding to each rank.
    pub(crate) hop1_to: Vec<bool>,
    /// Hop 1: whether this rank receives each rank's encoding.
    pub(crate) hop1_from: Vec<bool>,
    /// Hop 2 inside the node, when there is one.
    pub(crate) hop2: Option<DeltaHop2>,
    /// The owners of the shards this rank holds, in shard order.
    pub(crate) holds: std::ops::Range<usize>,
}

/// Hop 2 of [`DeltaRoute`]: first-group holders forward other nodes'
/// encodings to the holders of their index in the node's other groups.
#[derive(Debug, Clone)]
pub(crate) struct DeltaHop2 {
    /// The node's group (the all-to-all-v's members).
    pub(crate) node: Group,
    /// The ranks this rank forwards to (empty unless it is a first-group holder).
    pub(crate) to: Vec<usize>,
    /// The owners whose encodings it forwards, in order.
    pub(crate) forwards: Vec<usize>,
    /// Who forwards to this rank (a holder of a later group), if anyone.
    pub(crate) source: Option<usize>,
    /// The owners whose encodings arrive from `source`, in order.
    pub(crate) incoming: Vec<usize>,
}

impl DeltaRoute {
    /// The route of `rank` with hpZ groups of `hpz` ranks.
    pub(crate) fn new(t: &Topology, hpz: usize, rank: usize) -> Result<Self, CommError> {
        check_hpz(t, hpz)?;
        let w = t.world();
        let hop1_to = (0..w).map(|to| hop1_target(t, hpz, rank, to)).collect();
        let hop1_from = (0..w).map(|from| hop1_target(t, hpz, from, rank)).collect();
        let hop2 = (t.local_size() / hpz > 1 && t.nodes() > 1).then(|| {
            let (to, forwards) = hop2(t, hpz, rank);
            let (l, m) = (t.local_rank(rank), t.node_of(rank));
            let source = (l >= hpz).then(|| t.rank_of(m, l % hpz));
            let incoming = source.map(|s| hop2(t, hpz, s).1).unwrap_or_default();
            DeltaHop2 { node: Group::intra_node(t, rank), to, forwards, source, incoming }
        });
        let h = t.local_rank(rank) % hpz;
        let per = w / hpz;
        Ok(Self { hop1_to, hop1_from, hop2, holds: h * per..(h + 1) * per })
    }
}

/// qwZ-Δ's exchange (collective over the world): `delta` is this rank's
/// encoding of its primary shard's difference (the same length on every rank,
/// from [`delta_encode`]); returns the encodings of the shards this rank holds
/// in its hpZ secondary copy (hpZ groups of `hpz` ranks), in shard order: `W/H`
/// encodings of `delta.len()` bytes. The routing and the bytes are in the
/// [`collectives` module docs](crate::collectives).
///
/// ```
/// use zeropp_comm::collectives::{DeltaOptions, delta_apply, delta_encode, qwz_delta_exchange};
/// use zeropp_comm::{ThreadCluster, ThreadOptions, Topology};
/// let cluster = ThreadCluster::new(Topology::ranks(4).per_node(2)?, ThreadOptions::default());
/// let opts = DeltaOptions::default();
/// let holders = cluster.run(|comm| {
///     // Every rank owns 256 weights; every node's copy starts from zero.
///     let w = vec![0.01 * (comm.rank() + 1) as f32; 256];
///     let mut own = vec![0.0f32; 256];
///     let mut enc = vec![0u8; zeropp_comm::quant::encoded_len(opts.spec, 256)];
///     delta_encode(&w, &mut own, &opts, &mut enc)?;
///     // hpZ over the node: this rank holds 2 of the 4 shards.
///     let got = qwz_delta_exchange(comm, 2, &enc)?;
///     let mut copy = vec![0.0f32; 512];
///     for (k, e) in got.chunks(enc.len()).enumerate() {
///         delta_apply(&mut copy[k * 256..(k + 1) * 256], e, &opts)?;
///     }
///     Ok::<_, zeropp_comm::CommError>((own, copy))
/// })?;
/// // Rank 1 holds shards 2 and 3; rank 2's own reconstruction equals rank 1's copy.
/// assert_eq!(holders[1].1[..256], holders[2].0[..]);
/// // Within one INT4 step of the weights (the group maximum is clipped to 7/8 of it).
/// assert!((holders[1].1[256] - 0.04).abs() <= 0.04 / 8.0 + 1e-6);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn qwz_delta_exchange<C: Communicator + ?Sized>(
    comm: &mut C,
    hpz: usize,
    delta: &[u8],
) -> Result<Vec<u8>, CommError> {
    let t = *comm.topology();
    let (w, me, e) = (t.world(), comm.rank(), delta.len());
    let route = DeltaRoute::new(&t, hpz, me)?;
    // Hop 1: to the holders of my shard (own node: every group; other nodes: the first group).
    let bytes = |on: &[bool]| -> Vec<usize> { on.iter().map(|&b| if b { e } else { 0 }).collect() };
    let (send_counts, recv_counts) = (bytes(&route.hop1_to), bytes(&route.hop1_from));
    let send: Vec<u8> = send_counts.iter().filter(|&&c| c > 0).flat_map(|_| delta.iter().copied()).collect();
    let mut recv = vec![0u8; recv_counts.iter().sum()];
    comm.all_to_all_v_bytes(&Group::world(&t), &send, &send_counts, &mut recv, &recv_counts)?;
    // Received encodings by owner (ascending owner rank, as the all-to-all-v lays them out).
    let mut by_owner: Vec<Option<&[u8]>> = vec![None; w];
    let mut at = 0;
    for (from, &c) in recv_counts.iter().enumerate().filter(|&(_, &c)| c > 0) {
        by_owner[from] = recv.get(at..at + c);
        at += c;
    }
    // Hop 2: first-group holders forward other nodes' encodings to the node's other groups.
    let mut forwarded = Vec::new();
    if let Some(h2) = &route.hop2 {
        let mine: Vec<u8> =
            h2.forwards.iter().flat_map(|&r| by_owner[r].unwrap_or_default().iter().copied()).collect();
        let send_counts: Vec<usize> =
            h2.node.ranks().iter().map(|p| if h2.to.contains(p) { mine.len() } else { 0 }).collect();
        let incoming = h2.incoming.len() * e;
        let recv_counts: Vec<usize> =
            h2.node.ranks().iter().map(|&p| if Some(p) == h2.source { incoming } else { 0 }).collect();
        let send: Vec<u8> =
            send_counts.iter().filter(|&&c| c > 0).flat_map(|_| mine.iter().copied()).collect();
        forwarded = vec![0u8; incoming];
        comm.all_to_all_v_bytes(&h2.node, &send, &send_counts, &mut forwarded, &recv_counts)?;
    }
    if let Some(h2) = &route.hop2 {
        for (k, &r) in h2.incoming.iter().enumerate() {
            by_owner[r] = forwarded.get(k * e..(k + 1) * e);
        }
    }
    let mut out = Vec::with_capacity(route.holds.len() * e);
    for r in route.holds {
        let bytes = by_owner[r].ok_or_else(|| {
            CommError::Mismatch(format!("qwz delta: rank {me} got no difference of shard {r}"))
        })?;
        out.extend_from_slice(bytes);
    }
    Ok(out)
}

/// Bytes `rank` sends in a [`qwz_delta_exchange`] with hpZ groups of `hpz`
/// ranks and encodings of `e` bytes (see the [`collectives` module
/// docs](crate::collectives)). Not the same on every rank when `H < L`: average
/// over the ranks for a per-rank mean.
///
/// ```
/// use zeropp_comm::collectives::qwz_delta_bytes;
/// use zeropp_comm::Topology;
/// let t = Topology::ranks(8).per_node(4)?; // 2 nodes x 4, hpZ over the node
/// let b = qwz_delta_bytes(&t, 4, 0, 100)?;
/// // Rank 0's shard is held by local rank 0 on each node: itself, and rank 4.
/// assert_eq!((b.intra, b.inter), (0, 100));
/// # Ok::<(), zeropp_comm::CommError>(())
/// ```
pub fn qwz_delta_bytes(t: &Topology, hpz: usize, rank: usize, e: usize) -> Result<LinkBytes, CommError> {
    check_hpz(t, hpz)?;
    let mut out = LinkBytes::default();
    for to in (0..t.world()).filter(|&to| to != rank && hop1_target(t, hpz, rank, to)) {
        *LinkClass::between(t, rank, to).pick(&mut out.intra, &mut out.inter) += e as u64;
    }
    if t.nodes() > 1 {
        let (to, from) = hop2(t, hpz, rank);
        out.intra += (to.len() * from.len() * e) as u64;
    }
    Ok(out)
}

/// The owner's half of a difference step: encodes `Q(w − ŵ)` (`w` the new
/// weights of its shard, `ŵ` the reconstruction every holder has) into `out`
/// (at least `encoded_len(opts.spec, w.len())` bytes), then updates `ŵ` exactly
/// as [`delta_apply`] updates each holder's copy. Returns the bytes written.
///
/// The copy's element type `T` is what the holders keep (bf16 for a bf16 hpZ
/// copy, f32 for an exact one); every update rounds to it, on both sides.
pub fn delta_encode<T: Element>(
    w: &[f32],
    w_hat: &mut [T],
    opts: &DeltaOptions,
    out: &mut [u8],
) -> Result<usize, CommError> {
    if w.len() != w_hat.len() {
        return Err(CommError::Mismatch(format!(
            "qwz delta: {} weights against a reconstruction of {}",
            w.len(),
            w_hat.len()
        )));
    }
    let diff: Vec<f32> = w.iter().zip(w_hat.iter()).map(|(a, b)| a - b.to_f32()).collect();
    let n = quantize_to_wire(&diff, opts.spec, &opts.quant, out)?;
    apply(w_hat, out.get(..n).unwrap_or_default(), &opts.quant)?;
    Ok(n)
}

/// A holder's half: `ŵ ← round_T(ŵ + Deq(q))` for the encoding `enc` of one
/// shard's difference ([`delta_encode`]): the dequantized difference is added
/// in f32 and the sum rounded to `T` (to nearest, ties to even).
pub fn delta_apply<T: Element>(w_hat: &mut [T], enc: &[u8], opts: &DeltaOptions) -> Result<(), CommError> {
    apply(w_hat, enc, &opts.quant)
}

fn apply<T: Element>(w_hat: &mut [T], enc: &[u8], quant: &Options) -> Result<(), CommError> {
    let q = QuantizedRef::from_bytes(enc)?;
    if q.len() != w_hat.len() {
        return Err(CommError::Mismatch(format!(
            "qwz delta: a difference of {} elements for a copy of {}",
            q.len(),
            w_hat.len()
        )));
    }
    let mut sum = vec![0.0f32; q.len()];
    dequantize_into(&q, &mut sum, quant)?;
    sum.iter_mut().zip(w_hat.iter()).for_each(|(d, b)| *d += b.to_f32());
    T::from_f32_slice(&sum, w_hat);
    Ok(())
}

/// [`delta_apply`] timed on `comm`'s quantization clock (the engine's step-time split).
pub fn delta_apply_timed<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    w_hat: &mut [T],
    enc: &[u8],
    opts: &DeltaOptions,
) -> Result<(), CommError> {
    let clock = QuantClock::start();
    let r = delta_apply(w_hat, enc, opts);
    clock.stop(comm);
    r
}
