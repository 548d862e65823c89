//! The ZeRO++ collectives on device buffers, written once on
//! [`DeviceCommunicator`]: qwZ all-gather, hpZ gathers, the qgZ two-hop
//! reduce-scatter (with the fused dequantize-sum-requantize kernel) and the bf16
//! baselines they are measured against.
//!
//! They follow the host collectives of [`crate::collectives`] step by step (same
//! formats, same stochastic-rounding streams, same summation order, same byte
//! counts), with every payload staying on the device: quantized encodings are
//! built, exchanged and reduced in device buffers. On [`super::HostDevice`] the
//! results are bitwise equal to the host collectives on the thread backend (the
//! `device` tests), and the CUDA kernels are bit-identical to the CPU ones.
//!
//! qgZ (`qgz.rs`) executes the host's own schedule ([`QgzStages`](crate::collectives::QgzStages): which shard each
//! quantization encodes, in which format, with which rounding stream and
//! rotation, and where its bytes go), so the two cannot drift apart; only the
//! kernels differ.

mod delta;
mod qgz;
mod world;

use super::{Device, DeviceBuf, DeviceCommunicator, Elem, Kernel, View};
use crate::collectives::{QwzOptions, Reduce, check_shard, shard_range};
use crate::quant::encoded_len;
use crate::{CommError, Group};
pub use delta::{delta_apply, delta_encode, qwz_delta_exchange};
pub use qgz::{DeviceFeedback, qgz_reduce_scatter, qgz_reduce_scatter_with_feedback};
pub use world::{world_all_gather, world_qwz_all_gather, world_reduce_scatter};

fn index_in<C: DeviceCommunicator + ?Sized>(comm: &C, group: &Group) -> Result<usize, CommError> {
    group.index_of(comm.rank()).ok_or_else(|| {
        CommError::InvalidGroup(format!("rank {} is not a member of group {:?}", comm.rank(), group.ranks()))
    })
}

fn elements<D: Device>(v: View<'_, D>, elem: Elem, what: &str) -> Result<usize, CommError> {
    if !v.len().is_multiple_of(elem.size()) {
        return Err(CommError::Mismatch(format!(
            "{what}: a device window of {} bytes is not whole {elem:?} values",
            v.len()
        )));
    }
    Ok(v.len() / elem.size())
}

/// The mean's division and the padding's zeroes, as the host `finish_shard`.
fn finish<C: DeviceCommunicator + ?Sized>(
    comm: &C,
    shard: View<'_, C::Device>,
    n: usize,
    parts: usize,
    index: usize,
    reduce: Reduce,
    ranks: usize,
) -> Result<(), CommError> {
    let (dev, s) = (comm.device(), comm.stream());
    if reduce == Reduce::Mean && ranks > 1 {
        dev.kernel(s, Kernel::Div { buf: shard, by: ranks as f32 })?;
    }
    let real = 4 * shard_range(n, parts, index).len();
    dev.zero(s, shard.slice(real, shard.len().saturating_sub(real))?)
}

/// Runs `f` on part `index` (`s` f32 values) of the f32 vector `full` of `n`
/// values, padded with zeros on the device when the part runs past `n`.
fn with_part<C: DeviceCommunicator + ?Sized>(
    comm: &C,
    full: View<'_, C::Device>,
    n: usize,
    s: usize,
    index: usize,
    f: impl FnOnce(View<'_, C::Device>) -> Result<(), CommError>,
) -> Result<(), CommError> {
    let lo = index.saturating_mul(s).min(n);
    let hi = index.saturating_add(1).saturating_mul(s).min(n);
    let real = full.slice(4 * lo, 4 * (hi - lo))?;
    if hi - lo == s {
        return f(real);
    }
    let padded = DeviceBuf::zeroed(comm.device(), 4 * s)?;
    comm.device().copy(comm.stream(), real, padded.slice(0, real.len())?)?;
    f(padded.view())
}

/// Runs a quantization kernel, timed to completion when the communicator has a
/// [`QuantTimer`](super::QuantTimer).
fn quant<C: DeviceCommunicator + ?Sized>(comm: &C, kernel: Kernel<'_, C::Device>) -> Result<(), CommError> {
    let (dev, s) = (comm.device(), comm.stream());
    let Some(timer) = comm.quant_timer() else { return dev.kernel(s, kernel) };
    dev.synchronize(s)?;
    let t = std::time::Instant::now();
    dev.kernel(s, kernel)?;
    dev.synchronize(s)?;
    timer.add(t.elapsed());
    Ok(())
}

/// Checks that `full` holds `count` elements of type `out`.
fn check_full<D: Device>(full: View<'_, D>, out: Elem, count: usize, what: &str) -> Result<(), CommError> {
    if full.len() != out.size() * count {
        return Err(CommError::Mismatch(format!(
            "{what}: an output of {} bytes for {count} {out:?} elements",
            full.len()
        )));
    }
    Ok(())
}

/// Where a gather dequantizes `count` f32 values for an output of type `out`:
/// into the output itself (`None`, f32), or into one f32 staging buffer that
/// [`round_out`] then rounds into it (bf16), so a whole gather is one
/// allocation and one rounding kernel, not one per member.
fn f32_staging<D: Device>(dev: &D, out: Elem, count: usize) -> Result<Option<DeviceBuf<D>>, CommError> {
    match out {
        Elem::F32 => Ok(None),
        Elem::Bf16 => DeviceBuf::zeroed(dev, 4 * count).map(Some),
    }
}

/// Chunk `j` (`c` f32 values) of the dequantization target: the staging
/// buffer when there is one, else `full`.
fn f32_chunk<'a, D: Device>(
    staging: Option<&'a DeviceBuf<D>>,
    full: View<'a, D>,
    j: usize,
    c: usize,
) -> Result<View<'a, D>, CommError> {
    match staging {
        Some(s) => s.view().chunk(j, 4 * c),
        None => full.chunk(j, 4 * c),
    }
}

/// Rounds the staging buffer's f32 values into the bf16 output `full`, to
/// nearest even (what the host's dequantization into bf16 does).
fn round_out<C: DeviceCommunicator + ?Sized>(
    comm: &C,
    staging: Option<&DeviceBuf<C::Device>>,
    full: View<'_, C::Device>,
) -> Result<(), CommError> {
    match staging {
        Some(s) if !s.is_empty() => {
            comm.device().kernel(comm.stream(), Kernel::ToBf16 { src: s.view(), dst: full })
        }
        _ => Ok(()),
    }
}

/// qwZ all-gather on device buffers: quantizes `shard` (`c` values of type
/// `elem`) on the device, all-gathers the wire encodings (`E(spec, c)` bytes to
/// each other member, one message) and dequantizes every member's encoding into
/// `full` (`c·g` values of type `out`: f32, or bf16 rounded to nearest even),
/// like [`crate::collectives::qwz_all_gather`].
///
/// ```
/// use zeropp_comm::collectives::QwzOptions;
/// use zeropp_comm::device::{DeviceBuf, DeviceCluster, Elem, HostDevice, collectives::qwz_all_gather};
/// use zeropp_comm::{Group, ThreadOptions, Topology};
/// let cluster = DeviceCluster::new(Topology::ranks(2).per_node(2)?, HostDevice, ThreadOptions::default());
/// let fulls = cluster.run(|comm| {
///     let (dev, world) = (*comm.device(), Group::world(comm.topology()));
///     let x: Vec<f32> = (0..64).map(|i| (comm.rank() * 64 + i) as f32 / 128.0).collect();
///     let shard = DeviceBuf::from_f32(&dev, comm.stream(), &x)?;
///     let full = DeviceBuf::zeroed(&dev, 4 * 128)?;
///     qwz_all_gather(comm, &world, shard.view(), Elem::F32, full.view(), Elem::F32, &QwzOptions::default())?;
///     full.to_f32(&dev, comm.stream())
/// })?;
/// assert_eq!(fulls[0], fulls[1]);
/// assert!(fulls[0].iter().enumerate().all(|(i, x)| (x - i as f32 / 128.0).abs() <= 1.0 / 128.0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn qwz_all_gather<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    shard: View<'_, C::Device>,
    elem: Elem,
    full: View<'_, C::Device>,
    out: Elem,
    opts: &QwzOptions,
) -> Result<(), CommError> {
    let g = group.size();
    let c = elements(shard, elem, "qwz_all_gather")?;
    check_full(full, out, c * g, "qwz_all_gather")?;
    index_in(comm, group)?;
    let dev = comm.device().clone();
    let e = encoded_len(opts.spec, c);
    let send = DeviceBuf::zeroed(&dev, e)?;
    quant(comm, Kernel::Quantize { src: shard, elem, spec: opts.spec, opts: opts.quant, dst: send.view() })?;
    let gathered = DeviceBuf::zeroed(&dev, e * g)?;
    comm.all_gather(group, send.view(), gathered.view())?;
    let staging = f32_staging(&dev, out, c * g)?;
    for j in 0..g {
        let src = gathered.view().chunk(j, e)?;
        let dst = f32_chunk(staging.as_ref(), full, j, c)?;
        quant(comm, Kernel::Dequantize { src, spec: opts.spec, len: c, dst, add: false })?;
    }
    round_out(comm, staging.as_ref(), full)
}

/// hpZ gather of the secondary shards: a dense all-gather of `shard` (any
/// element type, `full.len() == shard.len()·L`) over the caller's node
/// ([`Group::intra_node`]), so the backward gather never leaves the node.
pub fn hpz_all_gather<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    shard: View<'_, C::Device>,
    full: View<'_, C::Device>,
) -> Result<(), CommError> {
    let node = Group::intra_node(comm.topology(), comm.rank());
    comm.all_gather(&node, shard, full)
}

/// hpZ gather with an INT8 wire: [`qwz_all_gather`] over the caller's node.
pub fn hpz_qwz_all_gather<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    shard: View<'_, C::Device>,
    elem: Elem,
    full: View<'_, C::Device>,
    out: Elem,
    opts: &QwzOptions,
) -> Result<(), CommError> {
    let node = Group::intra_node(comm.topology(), comm.rank());
    qwz_all_gather(comm, &node, shard, elem, full, out, opts)
}

/// The bf16 baseline all-gather: a byte all-gather of bf16 shards
/// (`full.len() == shard.len()·g`), like [`crate::collectives::all_gather_bf16`].
pub fn all_gather_bf16<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    shard: View<'_, C::Device>,
    full: View<'_, C::Device>,
) -> Result<(), CommError> {
    elements(shard, Elem::Bf16, "all_gather_bf16")?;
    comm.all_gather(group, shard, full)
}

/// The bf16-wire baseline reduce-scatter: rounds `full` (f32, `n` values) to
/// bf16, all-to-all, sums the `g` parts in f32 in group order and applies
/// `reduce`, into `shard` (f32, `⌈n/g⌉` values), like
/// [`crate::collectives::dense_reduce_scatter`] with [`DenseWire::Bf16`](crate::collectives::DenseWire::Bf16).
pub fn reduce_scatter_bf16_wire<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    full: View<'_, C::Device>,
    shard: View<'_, C::Device>,
    reduce: Reduce,
) -> Result<(), CommError> {
    let g = group.size();
    let n = elements(full, Elem::F32, "reduce_scatter_bf16_wire")?;
    let s = check_shard(
        "reduce_scatter_bf16_wire",
        n,
        g,
        elements(shard, Elem::F32, "reduce_scatter_bf16_wire")?,
    )?;
    let me = index_in(comm, group)?;
    let dev = comm.device().clone();
    let send = DeviceBuf::zeroed(&dev, 2 * s * g)?;
    if n > 0 {
        dev.kernel(comm.stream(), Kernel::ToBf16 { src: full, dst: send.slice(0, 2 * n)? })?;
    }
    let recv = DeviceBuf::zeroed(&dev, 2 * s * g)?;
    comm.all_to_all(group, send.view(), recv.view())?;
    drop(send);
    dev.zero(comm.stream(), shard)?;
    if s > 0 {
        for j in 0..g {
            let src = recv.view().chunk(j, 2 * s)?;
            dev.kernel(comm.stream(), Kernel::Add { src, elem: Elem::Bf16, dst: shard })?;
        }
    }
    finish(comm, shard, n, g, me, reduce, g)
}
