//! The world gathers and reduce-scatters of [`crate::collectives`]'
//! `world_all_gather` and `world_reduce_scatter` on device buffers, flat or
//! hierarchical ([`Routing`]), with an f32 or bf16 wire ([`DenseWire`]): the
//! ZeRO-3 baseline's collectives and the routes of its world gathers.
//!
//! They take the host's steps in the host's order (the rail hop, then the
//! node hop; slot `l·N + m` from rank `(m, l)`; partial sums in local-rank,
//! then node order, what never travels kept in f32), so on
//! [`HostDevice`](crate::device::HostDevice) their results are the host's bit
//! for bit (the `device` tests) and their bytes are
//! [`world_all_gather_bytes`](crate::collectives::world_all_gather_bytes) and
//! [`world_reduce_scatter_bytes`](crate::collectives::world_reduce_scatter_bytes).

use super::{
    check_full, elements, f32_chunk, f32_staging, finish, index_in, quant, reduce_scatter_bf16_wire,
    round_out, with_part,
};
use crate::collectives::{DenseWire, QwzOptions, Reduce, Routing, check_shard};
use crate::device::{Device, DeviceBuf, DeviceCommunicator, Elem, Kernel, View};
use crate::quant::encoded_len;
use crate::{CommError, Group};

fn elem_of(wire: DenseWire) -> Elem {
    match wire {
        DenseWire::F32 => Elem::F32,
        DenseWire::Bf16 => Elem::Bf16,
    }
}

/// Which way [`convert`] goes between f32 and a dense wire's type.
#[derive(Clone, Copy)]
enum Way {
    /// The f32 vector `src` into `dst` in the wire's type (bf16 rounds to
    /// nearest even).
    Narrow,
    /// The wire values `src` into the f32 vector `dst`, exactly.
    Widen,
}

/// Converts `src` into `dst` between f32 and `wire`'s type, `way`.
fn convert<C: DeviceCommunicator + ?Sized>(
    comm: &C,
    wire: DenseWire,
    way: Way,
    src: View<'_, C::Device>,
    dst: View<'_, C::Device>,
) -> Result<(), CommError> {
    let (dev, s) = (comm.device(), comm.stream());
    match (wire, way) {
        (DenseWire::F32, _) => dev.copy(s, src, dst),
        (DenseWire::Bf16, Way::Narrow) => dev.kernel(s, Kernel::ToBf16 { src, dst }),
        (DenseWire::Bf16, Way::Widen) => dev.kernel(s, Kernel::FromBf16 { src, dst }),
    }
}

/// All-gather of every rank's f32 shard (`c` values) over the world into
/// `full` (`c·W` f32, rank `r`'s shard at `[r·c, (r+1)·c)`), sent as `wire`:
/// the device twin of [`crate::collectives::world_all_gather`], bitwise equal
/// to it on [`HostDevice`](crate::device::HostDevice) for either routing.
///
/// ```
/// use zeropp_comm::collectives::{DenseWire, Routing};
/// use zeropp_comm::device::{DeviceBuf, DeviceCluster, HostDevice, collectives::world_all_gather};
/// use zeropp_comm::{ThreadOptions, Topology};
/// let cluster = DeviceCluster::new(Topology::ranks(4).per_node(2)?, HostDevice, ThreadOptions::default());
/// let fulls = cluster.run(|comm| {
///     let dev = *comm.device();
///     let shard = DeviceBuf::from_f32(&dev, comm.stream(), &[comm.rank() as f32, 0.5])?;
///     let full = DeviceBuf::zeroed(&dev, 4 * 8)?;
///     world_all_gather(comm, Routing::Hierarchical, DenseWire::Bf16, shard.view(), full.view())?;
///     full.to_f32(&dev, comm.stream())
/// })?;
/// let expect: Vec<f32> = (0..4).flat_map(|r| [r as f32, 0.5]).collect();
/// assert!(fulls.iter().all(|f| f == &expect));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn world_all_gather<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    routing: Routing,
    wire: DenseWire,
    shard: View<'_, C::Device>,
    full: View<'_, C::Device>,
) -> Result<(), CommError> {
    const WHAT: &str = "world_all_gather";
    let topo = *comm.topology();
    let w = topo.world();
    let c = elements(shard, Elem::F32, WHAT)?;
    if full.len() != 4 * c * w {
        return Err(CommError::Mismatch(format!(
            "{WHAT}: output of {} elements for {w} shards of {c}",
            full.len() / 4
        )));
    }
    let eb = elem_of(wire).size() * c;
    let mine = DeviceBuf::zeroed(comm.device(), eb)?;
    if c > 0 {
        convert(comm, wire, Way::Narrow, shard, mine.view())?;
    }
    let gathered = gather(comm, routing, mine.view())?;
    if c == 0 {
        return Ok(());
    }
    gathered.each(|r, src| convert(comm, wire, Way::Widen, src, full.chunk(r, 4 * c)?))
}

/// qwZ's world gather on device buffers: `shard` (`c` values of type `elem`)
/// quantized once, the encodings gathered by `routing` (forwarded as they are,
/// never requantized) and every rank's dequantized into its world position of
/// `full` (`c·W` values of type `out`: f32, or bf16 rounded to nearest even):
/// the device twin of
/// [`crate::collectives::world_qwz_all_gather`], bitwise equal to it on
/// [`HostDevice`](crate::device::HostDevice) for either routing, with its bytes
/// ([`world_qwz_bytes`](crate::collectives::world_qwz_bytes)).
pub fn world_qwz_all_gather<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    routing: Routing,
    shard: View<'_, C::Device>,
    elem: Elem,
    full: View<'_, C::Device>,
    out: Elem,
    opts: &QwzOptions,
) -> Result<(), CommError> {
    const WHAT: &str = "world_qwz_all_gather";
    let w = comm.topology().world();
    let c = elements(shard, elem, WHAT)?;
    check_full(full, out, c * w, WHAT)?;
    let e = encoded_len(opts.spec, c);
    let mine = DeviceBuf::zeroed(comm.device(), e)?;
    quant(comm, Kernel::Quantize { src: shard, elem, spec: opts.spec, opts: opts.quant, dst: mine.view() })?;
    let gathered = gather(comm, routing, mine.view())?;
    let staging = f32_staging(comm.device(), out, c * w)?;
    gathered.each(|r, src| {
        let dst = f32_chunk(staging.as_ref(), full, r, c)?;
        quant(comm, Kernel::Dequantize { src, spec: opts.spec, len: c, dst, add: false })
    })?;
    round_out(comm, staging.as_ref(), full)
}

/// The world's chunks gathered by `routing`, each with the rank it came from.
struct Gathered<D: Device> {
    buf: DeviceBuf<D>,
    /// Rank of each chunk, in buffer order.
    ranks: Vec<usize>,
    chunk: usize,
}

impl<D: Device> Gathered<D> {
    /// Calls `f(rank, chunk)` for every gathered chunk, in buffer order.
    fn each(&self, mut f: impl FnMut(usize, View<'_, D>) -> Result<(), CommError>) -> Result<(), CommError> {
        for (i, &r) in self.ranks.iter().enumerate() {
            f(r, self.buf.view().chunk(i, self.chunk)?)?;
        }
        Ok(())
    }
}

/// Gathers every rank's `mine` (the same byte length everywhere) over the
/// world: flat, or over the rail and then the node (slot `l·N + m` from rank
/// `(m, l)`); the bytes are forwarded as they are.
fn gather<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    routing: Routing,
    mine: View<'_, C::Device>,
) -> Result<Gathered<C::Device>, CommError> {
    let topo = *comm.topology();
    let (w, nodes, local, rank) = (topo.world(), topo.nodes(), topo.local_size(), comm.rank());
    let (dev, e) = (comm.device().clone(), mine.len());
    let buf = DeviceBuf::zeroed(&dev, e * w)?;
    if routing == Routing::Flat {
        comm.all_gather(&Group::world(&topo), mine, buf.view())?;
        return Ok(Gathered { buf, ranks: (0..w).collect(), chunk: e });
    }
    let rail = DeviceBuf::zeroed(&dev, e * nodes)?;
    if nodes > 1 {
        comm.all_gather(&Group::rail(&topo, rank), mine, rail.view())?;
    } else {
        dev.copy(comm.stream(), mine, rail.view())?;
    }
    if local > 1 {
        comm.all_gather(&Group::intra_node(&topo, rank), rail.view(), buf.view())?;
    } else {
        dev.copy(comm.stream(), rail.view(), buf.view())?;
    }
    let ranks = (0..local).flat_map(|l| (0..nodes).map(move |m| topo.rank_of(m, l))).collect();
    Ok(Gathered { buf, ranks, chunk: e })
}

/// Reduce-scatter of this rank's f32 tensor `full` (`n` values, padded with
/// zeros to `W·s`) over the world: `shard` (`s = ⌈n/W⌉` f32) receives shard
/// `rank` of the sum or mean, its padding zeroed, with everything that travels
/// sent as `wire` and every sum in f32: the device twin of
/// [`crate::collectives::world_reduce_scatter`], bitwise equal to it on
/// [`HostDevice`](crate::device::HostDevice) for either routing.
pub fn world_reduce_scatter<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    routing: Routing,
    wire: DenseWire,
    full: View<'_, C::Device>,
    shard: View<'_, C::Device>,
    reduce: Reduce,
) -> Result<(), CommError> {
    const WHAT: &str = "world_reduce_scatter";
    let topo = *comm.topology();
    let world = Group::world(&topo);
    match (routing, wire) {
        (Routing::Flat, DenseWire::Bf16) => {
            return reduce_scatter_bf16_wire(comm, &world, full, shard, reduce);
        }
        (Routing::Flat, DenseWire::F32) => return flat_f32(comm, &world, full, shard, reduce),
        (Routing::Hierarchical, _) => {}
    }
    let (w, nodes, local, rank) = (topo.world(), topo.nodes(), topo.local_size(), comm.rank());
    let n = elements(full, Elem::F32, WHAT)?;
    let s = check_shard(WHAT, n, w, elements(shard, Elem::F32, WHAT)?)?;
    let (me_node, me_local) = (topo.node_of(rank), topo.local_rank(rank));
    let dev = comm.device().clone();
    let (elem, st) = (elem_of(wire), comm.stream());
    let eb = elem.size() * s;
    // Slot m: this node's partial sum of shard (m, me_local), in f32.
    let partial = DeviceBuf::zeroed(&dev, 4 * s * nodes)?;
    if local > 1 {
        // Hop 1: the chunk for local peer j holds the shards of (m, j), m = 0..N;
        // the own chunk is not sent (its slot stays zero and is never read).
        let send = DeviceBuf::zeroed(&dev, eb * nodes * local)?;
        for j in (0..local).filter(|&j| j != me_local) {
            for m in 0..nodes {
                let out = send.view().chunk(j * nodes + m, eb)?;
                with_part(comm, full, n, s, topo.rank_of(m, j), |x| {
                    convert(comm, wire, Way::Narrow, x, out)
                })?;
            }
        }
        let recv = DeviceBuf::zeroed(&dev, eb * nodes * local)?;
        comm.all_to_all(&Group::intra_node(&topo, rank), send.view(), recv.view())?;
        drop(send);
        // The L contributions in local-rank order; the own one in f32.
        let st = comm.stream();
        for m in 0..nodes {
            let acc = partial.view().chunk(m, 4 * s)?;
            for j in 0..local {
                if j == me_local {
                    with_part(comm, full, n, s, topo.rank_of(m, j), |x| {
                        dev.kernel(st, Kernel::Add { src: x, elem: Elem::F32, dst: acc })
                    })?;
                } else {
                    let got = recv.view().chunk(j * nodes + m, eb)?;
                    dev.kernel(st, Kernel::Add { src: got, elem, dst: acc })?;
                }
            }
        }
    } else {
        // One rank per node: the partials are this rank's own parts.
        for m in 0..nodes {
            let dst = partial.view().chunk(m, 4 * s)?;
            with_part(comm, full, n, s, topo.rank_of(m, me_local), |x| dev.copy(st, x, dst))?;
        }
    }
    if nodes > 1 {
        // Hop 2: partial m goes to rail peer m; the own node's partial stays f32.
        let send = DeviceBuf::zeroed(&dev, eb * nodes)?;
        for m in (0..nodes).filter(|&m| m != me_node) {
            convert(comm, wire, Way::Narrow, partial.view().chunk(m, 4 * s)?, send.view().chunk(m, eb)?)?;
        }
        let recv = DeviceBuf::zeroed(&dev, eb * nodes)?;
        comm.all_to_all(&Group::rail(&topo, rank), send.view(), recv.view())?;
        drop(send);
        let st = comm.stream();
        dev.zero(st, shard)?;
        for m in 0..nodes {
            let (src, elem) = if m == me_node {
                (partial.view().chunk(m, 4 * s)?, Elem::F32)
            } else {
                (recv.view().chunk(m, eb)?, elem)
            };
            dev.kernel(st, Kernel::Add { src, elem, dst: shard })?;
        }
    } else {
        dev.copy(comm.stream(), partial.view().chunk(0, 4 * s)?, shard)?;
    }
    finish(comm, shard, n, w, rank, reduce, w)
}

/// The exact f32 reduce-scatter over `group` (the backend's, padded to `s·g`
/// when `n` is not), as the host's `dense_reduce_scatter` with an f32 wire.
fn flat_f32<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    full: View<'_, C::Device>,
    shard: View<'_, C::Device>,
    reduce: Reduce,
) -> Result<(), CommError> {
    const WHAT: &str = "reduce_scatter";
    let g = group.size();
    let n = elements(full, Elem::F32, WHAT)?;
    let s = check_shard(WHAT, n, g, elements(shard, Elem::F32, WHAT)?)?;
    let me = index_in(comm, group)?;
    if n == s * g {
        comm.reduce_scatter_f32(group, full, shard)?;
    } else {
        let dev = comm.device().clone();
        let padded = DeviceBuf::zeroed(&dev, 4 * s * g)?;
        dev.copy(comm.stream(), full, padded.slice(0, 4 * n)?)?;
        comm.reduce_scatter_f32(group, padded.view(), shard)?;
    }
    finish(comm, shard, n, g, me, reduce, g)
}
