//! ZeRO-3 baselines: plain all-gather (f32 or 16-bit) and reduce-scatter.

use half::bf16;

use super::{DenseWire, Reduce, check_shard, finish_shard, my_index, shard_len};
use crate::{CommError, CommExt, Communicator, Group, LinkBytes, Topology, slices};

/// Bytes `rank` sends in a dense all-gather on `group` ([`all_gather_f32`],
/// [`all_gather_bf16`], [`all_gather_f32_via_bf16`]) of a shard of `shard_len`
/// elements of `elem_bytes` bytes: `elem_bytes·shard_len` to each other member.
///
/// ```
/// use zeropp_comm::collectives::group_all_gather_bytes;
/// use zeropp_comm::{Group, LinkBytes, Topology};
/// let t = Topology::ranks(8).per_node(4)?;
/// let b = group_all_gather_bytes(&t, 0, &Group::world(&t), 2, 10);
/// assert_eq!(b, LinkBytes { intra: 3 * 20, inter: 4 * 20 });
/// # Ok::<(), zeropp_comm::CommError>(())
/// ```
pub fn group_all_gather_bytes(
    topology: &Topology,
    rank: usize,
    group: &Group,
    elem_bytes: usize,
    shard_len: usize,
) -> LinkBytes {
    LinkBytes::to_members(topology, rank, group, (elem_bytes * shard_len) as u64)
}

/// Bytes `rank` sends in a dense reduce-scatter on `group` ([`dense_reduce_scatter`]
/// with `elem_bytes = wire.bytes()`) of a full tensor of
/// `n` elements: `elem_bytes·⌈n/g⌉` to each other member.
pub fn group_reduce_scatter_bytes(
    topology: &Topology,
    rank: usize,
    group: &Group,
    elem_bytes: usize,
    n: usize,
) -> LinkBytes {
    LinkBytes::to_members(topology, rank, group, (elem_bytes * shard_len(n, group.size())) as u64)
}

/// The plain dense all-gathers, one per element type (the body is the typed
/// [`CommExt::all_gather`]): `full.len() == shard.len() * group.size()`.
macro_rules! dense_all_gathers {
    ($($(#[$doc:meta])* $name:ident: $t:ty;)+) => {$(
        $(#[$doc])*
        pub fn $name<C: Communicator + ?Sized>(comm: &mut C, group: &Group, shard: &[$t], full: &mut [$t]) -> Result<(), CommError> {
            comm.all_gather(group, shard, full)
        }
    )+};
}

dense_all_gathers! {
    /// Plain f32 all-gather: `full.len() == shard.len() * group.size()`.
    /// Sends `4·shard.len()` bytes to each other member.
    all_gather_f32: f32;
    /// 16-bit all-gather of bf16 parameters (ZeRO-3's fp16/bf16 gather).
    /// Sends `2·shard.len()` bytes to each other member.
    all_gather_bf16: bf16;
}

/// All-gather of f32 parameters with bf16 on the wire (rounded to nearest even),
/// widened back to f32. Sends `2·shard.len()` bytes to each other member.
pub fn all_gather_f32_via_bf16<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    shard: &[f32],
    full: &mut [f32],
) -> Result<(), CommError> {
    let g = group.size();
    if full.len() != shard.len() * g {
        return Err(CommError::Mismatch(format!(
            "all_gather_f32_via_bf16: output of {} elements for {g} shards of {}",
            full.len(),
            shard.len()
        )));
    }
    let narrow: Vec<bf16> = shard.iter().map(|&x| bf16::from_f32(x)).collect();
    let mut gathered = vec![bf16::ZERO; full.len()];
    comm.all_gather(group, &narrow, &mut gathered)?;
    for (d, s) in full.iter_mut().zip(&gathered) {
        *d = s.to_f32();
    }
    Ok(())
}

/// f32 reduce-scatter of a full tensor of `n` elements: member `i` gets part `i`
/// (`shard.len() == ⌈n/g⌉`, padding set to 0) of the sum or mean over members.
/// Sends `4·⌈n/g⌉` bytes to each other member. [`dense_reduce_scatter`] with
/// [`DenseWire::F32`].
pub fn reduce_scatter<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    full: &[f32],
    shard: &mut [f32],
    reduce: Reduce,
) -> Result<(), CommError> {
    dense_reduce_scatter(comm, group, DenseWire::F32, full, shard, reduce)
}

/// Reduce-scatter of a full tensor of `n` elements with `wire` on the wire:
/// member `i` gets part `i` (`shard.len() == ⌈n/g⌉`, padding set to 0) of the sum
/// or mean over members. Sends `wire.bytes()·⌈n/g⌉` bytes to each other member.
///
/// With [`DenseWire::F32`] it is the backend's exact f32 reduce-scatter; with
/// [`DenseWire::Bf16`] the parts are rounded to bf16, exchanged by an
/// all-to-all, and summed in f32 (in group order).
pub fn dense_reduce_scatter<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    wire: DenseWire,
    full: &[f32],
    shard: &mut [f32],
    reduce: Reduce,
) -> Result<(), CommError> {
    let g = group.size();
    let n = full.len();
    let what = match wire {
        DenseWire::F32 => "reduce_scatter",
        DenseWire::Bf16 => "reduce_scatter_bf16_wire",
    };
    let s = check_shard(what, n, g, shard.len())?;
    let me = my_index(comm, group)?;
    match wire {
        DenseWire::F32 if n == s * g => comm.reduce_scatter_f32(group, full, shard)?,
        DenseWire::F32 => {
            let mut padded = vec![0.0f32; s * g];
            slices::copy_to(&mut padded, 0, full, "reduce_scatter: padded input")?;
            comm.reduce_scatter_f32(group, &padded, shard)?;
        }
        DenseWire::Bf16 => {
            let mut send = vec![bf16::ZERO; s * g];
            for (d, x) in send.iter_mut().zip(full) {
                *d = bf16::from_f32(*x);
            }
            let mut recv = vec![bf16::ZERO; s * g];
            comm.all_to_all(group, &send, &mut recv)?;
            drop(send);
            shard.fill(0.0);
            // The g received parts, in group order (none to add when the shards are empty).
            if s > 0 {
                for part in recv.chunks_exact(s) {
                    shard.iter_mut().zip(part).for_each(|(a, b)| *a += b.to_f32());
                }
            }
        }
    }
    finish_shard(shard, n, g, me, reduce, g);
    Ok(())
}
