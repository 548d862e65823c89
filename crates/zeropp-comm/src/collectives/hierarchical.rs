//! World collectives with a choice of [`Routing`]: flat (every rank with every
//! rank) or hierarchical (the inter-node hop over the rail, the intra-node hop over
//! the node, as NCCL and torch HSDP route), for the dense baselines and for qwZ.
//!
//! Rank `r = (m, l)` is local rank `l` of node `m` ([`Topology::rank_of`]); `N`
//! nodes × `L` ranks per node, `W = N·L`.
//!
//! - **Gathers** (dense and qwZ): all-gather over [`Group::rail`] (rank `(m, l)`
//!   then holds the shards of `(m', l)` for all `m'`), then all-gather of that
//!   `N`-shard chunk over [`Group::intra_node`], then every shard is put at its
//!   world position. Gathers only copy, so the result is bit-identical to the flat
//!   gather.
//! - **Reduce-scatter**: an intra-node all-to-all where the chunk for local peer `j`
//!   holds the shards of ranks `(m', j)`, `m' = 0..N` (qgZ's slice reordering),
//!   summed in f32 in local-rank order into one partial per node; then the partial
//!   for node `m'` goes to rail peer `m'` by an all-to-all, and the `N` partials are
//!   summed in f32 in node order. What never leaves a rank (its own chunk at hop 1,
//!   its own node's partial at hop 2) stays f32; everything on the wire is in the
//!   [`DenseWire`] type.
//!
//! A hop whose group has one member (`N = 1` or `L = 1`) is skipped.

use bytemuck::Pod;
use half::bf16;

use super::{
    DenseWire, Reduce, Routing, all_gather_f32, all_gather_f32_via_bf16, check_shard, dense_reduce_scatter,
    finish_shard, group_all_gather_bytes, group_reduce_scatter_bytes, shard_len, with_part,
};
use crate::{CommError, CommExt, Communicator, Group, LinkBytes, Topology, slices};

/// A dense element type on the wire: narrowed from f32 before sending, widened after.
trait WireElem: Pod {
    fn narrow(x: f32) -> Self;
    fn widen(self) -> f32;
}

// `#[inline]`: these are called once per element from generic loops in other
// codegen units, which cannot inline a non-generic function without it.
impl WireElem for f32 {
    #[inline]
    fn narrow(x: f32) -> Self {
        x
    }
    #[inline]
    fn widen(self) -> f32 {
        self
    }
}

impl WireElem for bf16 {
    /// Round to nearest even, as [`all_gather_f32_via_bf16`] does.
    #[inline]
    fn narrow(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// Slot `index` of `len` elements of `buf`, or an error naming `what`.
fn slot<'a, T>(what: &str, buf: &'a [T], index: usize, len: usize) -> Result<&'a [T], CommError> {
    slices::chunk(buf, index, len, what)
}

/// Mutable slot `index` of `len` elements of `buf`, or an error naming `what`.
fn slot_mut<'a, T>(what: &str, buf: &'a mut [T], index: usize, len: usize) -> Result<&'a mut [T], CommError> {
    slices::window_mut(buf, index.saturating_mul(len), len, what)
}

/// The two gather hops: all-gather `mine` over the rail, then the `N`-chunk result
/// over the node. Returns `W` chunks of `mine.len()` in (local rank, node) order:
/// chunk `l·N + m` came from rank `(m, l)`.
pub(super) fn gather_two_hop<C: Communicator + ?Sized, T: Pod>(
    comm: &mut C,
    topo: &Topology,
    mine: Vec<T>,
) -> Result<Vec<T>, CommError> {
    let rank = comm.rank();
    let (nodes, local) = (topo.nodes(), topo.local_size());
    let rail = if nodes > 1 {
        let mut buf = vec![T::zeroed(); mine.len() * nodes];
        comm.all_gather(&Group::rail(topo, rank), &mine, &mut buf)?;
        buf
    } else {
        mine
    };
    if local > 1 {
        let mut buf = vec![T::zeroed(); rail.len() * local];
        comm.all_gather(&Group::intra_node(topo, rank), &rail, &mut buf)?;
        Ok(buf)
    } else {
        Ok(rail)
    }
}

/// Moves the chunks of [`gather_two_hop`]'s (local rank, node) order to world
/// rank order, converting each element with `f`.
pub(super) fn to_world_order<T: Copy, U>(
    what: &str,
    topo: &Topology,
    gathered: &[T],
    c: usize,
    out: &mut [U],
    f: impl Fn(T) -> U,
) -> Result<(), CommError> {
    let nodes = topo.nodes();
    for l in 0..topo.local_size() {
        for m in 0..nodes {
            let src = slot(what, gathered, l * nodes + m, c)?;
            let dst = slot_mut(what, out, topo.rank_of(m, l), c)?;
            dst.iter_mut().zip(src).for_each(|(d, &s)| *d = f(s));
        }
    }
    Ok(())
}

/// All-gather of every rank's f32 shard over the whole world of
/// `comm.topology()`: `full.len() == shard.len() · W`, rank `r`'s shard at
/// `[r·c, (r+1)·c)`, sent as `wire` (bf16 rounds to nearest even, like
/// [`all_gather_f32_via_bf16`]).
///
/// [`Routing::Flat`] is [`all_gather_f32`] / [`all_gather_f32_via_bf16`] on
/// [`Group::world`]; [`Routing::Hierarchical`] gathers over the rail, then over
/// the node, and gives the bit-identical result. Bytes per rank:
/// [`world_all_gather_bytes`].
///
/// ```
/// use zeropp_comm::collectives::{DenseWire, Routing, world_all_gather};
/// use zeropp_comm::{ThreadCluster, ThreadOptions, Topology};
/// let cluster = ThreadCluster::new(Topology::ranks(6).per_node(3)?, ThreadOptions::default());
/// let fulls = cluster.run(|comm| {
///     let shard = [comm.rank() as f32, 0.5];
///     let mut full = vec![0.0f32; 12];
///     world_all_gather(comm, Routing::Hierarchical, DenseWire::Bf16, &shard, &mut full)?;
///     Ok::<_, zeropp_comm::CommError>(full)
/// })?;
/// let expect: Vec<f32> = (0..6).flat_map(|r| [r as f32, 0.5]).collect();
/// assert!(fulls.iter().all(|f| f == &expect));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn world_all_gather<C: Communicator + ?Sized>(
    comm: &mut C,
    routing: Routing,
    wire: DenseWire,
    shard: &[f32],
    full: &mut [f32],
) -> Result<(), CommError> {
    let world = Group::world(comm.topology());
    match (routing, wire) {
        (Routing::Flat, DenseWire::F32) => all_gather_f32(comm, &world, shard, full),
        (Routing::Flat, DenseWire::Bf16) => all_gather_f32_via_bf16(comm, &world, shard, full),
        (Routing::Hierarchical, DenseWire::F32) => hier_all_gather::<C, f32>(comm, shard, full),
        (Routing::Hierarchical, DenseWire::Bf16) => hier_all_gather::<C, bf16>(comm, shard, full),
    }
}

fn hier_all_gather<C: Communicator + ?Sized, T: WireElem>(
    comm: &mut C,
    shard: &[f32],
    full: &mut [f32],
) -> Result<(), CommError> {
    const WHAT: &str = "world_all_gather";
    let topo = *comm.topology();
    let (w, c) = (topo.world(), shard.len());
    if full.len() != c * w {
        return Err(CommError::Mismatch(format!(
            "{WHAT}: output of {} elements for {w} shards of {c}",
            full.len()
        )));
    }
    let narrow: Vec<T> = shard.iter().map(|&x| T::narrow(x)).collect();
    let gathered = gather_two_hop(comm, &topo, narrow)?;
    to_world_order(WHAT, &topo, &gathered, c, full, T::widen)
}

/// Bytes one rank sends in [`world_all_gather`] of a shard of `shard_len`
/// elements (the same on every rank). With `b = wire.bytes()`, `c = shard_len`:
/// flat sends `c·b` to each other rank, i.e. intra `(L-1)·c·b`, inter `(W-L)·c·b`;
/// hierarchical sends inter `(N-1)·c·b` (rail hop) and intra `(L-1)·N·c·b` (node hop).
///
/// ```
/// use zeropp_comm::collectives::{DenseWire, Routing, world_all_gather_bytes};
/// use zeropp_comm::{LinkBytes, Topology};
/// let t = Topology::ranks(8).per_node(4)?; // 2 nodes x 4
/// let flat = world_all_gather_bytes(&t, Routing::Flat, DenseWire::Bf16, 100);
/// let hier = world_all_gather_bytes(&t, Routing::Hierarchical, DenseWire::Bf16, 100);
/// assert_eq!(flat, LinkBytes { intra: 3 * 200, inter: 4 * 200 });
/// assert_eq!(hier, LinkBytes { intra: 3 * 2 * 200, inter: 200 });
/// # Ok::<(), zeropp_comm::CommError>(())
/// ```
pub fn world_all_gather_bytes(
    topology: &Topology,
    routing: Routing,
    wire: DenseWire,
    shard_len: usize,
) -> LinkBytes {
    match routing {
        Routing::Flat => {
            group_all_gather_bytes(topology, 0, &Group::world(topology), wire.bytes(), shard_len)
        }
        Routing::Hierarchical => two_hop_gather_bytes(topology, (wire.bytes() * shard_len) as u64),
    }
}

/// Hierarchical gather of one `chunk`-byte payload per rank: `(N-1)` chunks over
/// the rail, `(L-1)` messages of `N` chunks over the node.
pub(super) fn two_hop_gather_bytes(topology: &Topology, chunk: u64) -> LinkBytes {
    let (n, l) = (topology.nodes() as u64, topology.local_size() as u64);
    LinkBytes { intra: (l - 1) * n * chunk, inter: (n - 1) * chunk }
}

/// Reduce-scatter over the whole world of `comm.topology()`: `full` is this rank's
/// tensor of `n` elements (any `n`, padded with zeros to `W·s`, `s = ⌈n/W⌉`);
/// `shard` (`s` elements) receives shard `rank` of the sum or mean over all ranks,
/// its padding set to 0. Everything that travels is sent as `wire`; sums are f32.
///
/// [`Routing::Flat`] is [`dense_reduce_scatter`] (f32 or bf16 wire) on
/// [`Group::world`]. [`Routing::Hierarchical`] runs (1) an intra-node all-to-all
/// where the chunk for local peer `j` holds the shards of ranks `(m', j)`, summed in
/// local-rank order into one partial per node (the own chunk never travels and stays
/// f32), then (2) an all-to-all of the node partials over the rail (the own node's
/// partial stays f32), summed in node order; the mean divides by `W`. Each bf16 hop
/// rounds every value once (relative error `≤ 2^-9`). Bytes per rank:
/// [`world_reduce_scatter_bytes`].
///
/// ```
/// use zeropp_comm::collectives::{DenseWire, Reduce, Routing, shard_len, world_reduce_scatter};
/// use zeropp_comm::{ThreadCluster, ThreadOptions, Topology};
/// let cluster = ThreadCluster::new(Topology::ranks(4).per_node(2)?, ThreadOptions::default());
/// let n = 10;
/// let shards = cluster.run(|comm| {
///     let full: Vec<f32> = (0..n).map(|i| (i * (comm.rank() + 1)) as f32).collect();
///     let mut shard = vec![0.0f32; shard_len(n, 4)];
///     world_reduce_scatter(comm, Routing::Hierarchical, DenseWire::Bf16, &full, &mut shard, Reduce::Sum)?;
///     Ok::<_, zeropp_comm::CommError>(shard)
/// })?;
/// // Sum over ranks of i·(r+1) = 10·i; shard 3 holds element 9 and two padding zeros.
/// assert_eq!(shards[0], [0.0, 10.0, 20.0]);
/// assert_eq!(shards[3], [90.0, 0.0, 0.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn world_reduce_scatter<C: Communicator + ?Sized>(
    comm: &mut C,
    routing: Routing,
    wire: DenseWire,
    full: &[f32],
    shard: &mut [f32],
    reduce: Reduce,
) -> Result<(), CommError> {
    let world = Group::world(comm.topology());
    match (routing, wire) {
        (Routing::Flat, wire) => dense_reduce_scatter(comm, &world, wire, full, shard, reduce),
        (Routing::Hierarchical, DenseWire::F32) => hier_reduce_scatter::<C, f32>(comm, full, shard, reduce),
        (Routing::Hierarchical, DenseWire::Bf16) => hier_reduce_scatter::<C, bf16>(comm, full, shard, reduce),
    }
}

fn hier_reduce_scatter<C: Communicator + ?Sized, T: WireElem>(
    comm: &mut C,
    full: &[f32],
    shard: &mut [f32],
    reduce: Reduce,
) -> Result<(), CommError> {
    const WHAT: &str = "world_reduce_scatter";
    let topo = *comm.topology();
    let (w, nodes, local) = (topo.world(), topo.nodes(), topo.local_size());
    let rank = comm.rank();
    let n = full.len();
    let s = check_shard(WHAT, n, w, shard.len())?;
    let (me_node, me_local) = (topo.node_of(rank), topo.local_rank(rank));

    // Slot m: this node's partial sum of shard (m, me_local), in f32.
    let mut partial = vec![0.0f32; nodes * s];
    if local > 1 {
        // Hop 1: the chunk for local peer j holds the shards of (m, j), m = 0..N.
        // The own chunk is not sent (its slot stays zero and is never read).
        let chunk = nodes * s;
        let mut send = vec![T::zeroed(); chunk * local];
        for j in (0..local).filter(|&j| j != me_local) {
            for m in 0..nodes {
                let out = slot_mut(WHAT, &mut send, j * nodes + m, s)?;
                with_part(full, s, topo.rank_of(m, j), |x| {
                    out.iter_mut().zip(x).for_each(|(d, &v)| *d = T::narrow(v));
                })?;
            }
        }
        let mut recv = vec![T::zeroed(); chunk * local];
        comm.all_to_all(&Group::intra_node(&topo, rank), &send, &mut recv)?;
        drop(send);
        // Sum the L contributions in local-rank order; the own one in f32.
        for m in 0..nodes {
            let acc = slot_mut(WHAT, &mut partial, m, s)?;
            for j in 0..local {
                if j == me_local {
                    with_part(full, s, topo.rank_of(m, j), |x| {
                        acc.iter_mut().zip(x).for_each(|(a, &v)| *a += v);
                    })?;
                } else {
                    let got = slot(WHAT, &recv, j * nodes + m, s)?;
                    acc.iter_mut().zip(got).for_each(|(a, &v)| *a += v.widen());
                }
            }
        }
    } else {
        // One rank per node: the partials are this rank's own parts.
        for m in 0..nodes {
            let dst = slot_mut(WHAT, &mut partial, m, s)?;
            with_part(full, s, topo.rank_of(m, me_local), |x| dst.copy_from_slice(x))?;
        }
    }

    if nodes > 1 {
        // Hop 2: partial m goes to rail peer m; the own node's partial stays f32.
        let mut send = vec![T::zeroed(); nodes * s];
        for m in (0..nodes).filter(|&m| m != me_node) {
            let src = slot(WHAT, &partial, m, s)?;
            let dst = slot_mut(WHAT, &mut send, m, s)?;
            dst.iter_mut().zip(src).for_each(|(d, &v)| *d = T::narrow(v));
        }
        let mut recv = vec![T::zeroed(); nodes * s];
        comm.all_to_all(&Group::rail(&topo, rank), &send, &mut recv)?;
        drop(send);
        shard.fill(0.0);
        for m in 0..nodes {
            if m == me_node {
                let own = slot(WHAT, &partial, m, s)?;
                shard.iter_mut().zip(own).for_each(|(a, &v)| *a += v);
            } else {
                let got = slot(WHAT, &recv, m, s)?;
                shard.iter_mut().zip(got).for_each(|(a, &v)| *a += v.widen());
            }
        }
    } else {
        shard.copy_from_slice(slot(WHAT, &partial, 0, s)?);
    }
    finish_shard(shard, n, w, rank, reduce, w);
    Ok(())
}

/// Bytes one rank sends in [`world_reduce_scatter`] of a full tensor of `n`
/// elements (the same on every rank). With `s = ⌈n/W⌉`, `b = wire.bytes()`: flat
/// sends `s·b` to each other rank (intra `(L-1)·s·b`, inter `(W-L)·s·b`);
/// hierarchical sends intra `(L-1)·N·s·b` (hop 1) and inter `(N-1)·s·b` (hop 2).
///
/// ```
/// use zeropp_comm::collectives::{DenseWire, Routing, world_reduce_scatter_bytes};
/// use zeropp_comm::{LinkBytes, Topology};
/// let t = Topology::ranks(8).per_node(4)?; // 2 nodes x 4, s = 100
/// let flat = world_reduce_scatter_bytes(&t, Routing::Flat, DenseWire::Bf16, 800);
/// let hier = world_reduce_scatter_bytes(&t, Routing::Hierarchical, DenseWire::Bf16, 800);
/// assert_eq!(flat, LinkBytes { intra: 3 * 200, inter: 4 * 200 });
/// assert_eq!(hier, LinkBytes { intra: 3 * 2 * 200, inter: 200 });
/// # Ok::<(), zeropp_comm::CommError>(())
/// ```
pub fn world_reduce_scatter_bytes(
    topology: &Topology,
    routing: Routing,
    wire: DenseWire,
    n: usize,
) -> LinkBytes {
    match routing {
        Routing::Flat => group_reduce_scatter_bytes(topology, 0, &Group::world(topology), wire.bytes(), n),
        Routing::Hierarchical => {
            let (nodes, local) = (topology.nodes() as u64, topology.local_size() as u64);
            let sb = (shard_len(n, topology.world()) * wire.bytes()) as u64;
            LinkBytes { intra: (local - 1) * nodes * sb, inter: (nodes - 1) * sb }
        }
    }
}
