//! What every check of the suite shares: the case, each rank's inputs, the
//! sequential reference's arithmetic and the error helpers.

use half::bf16;
use zeropp_quant::rng::splitmix64 as splitmix;

use crate::collectives::{DenseWire, Reduce};
use crate::{CommError, Communicator, Group, Topology};

/// One conformance case: a seed for the data and a length parameter (elements per
/// rank; 0, 1, primes and large values are all valid).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Case {
    /// Seed of every rank's data.
    pub seed: u64,
    /// Length parameter (elements per shard or per rank, depending on the check).
    pub len: usize,
}

pub(super) fn key(seed: u64, rank: usize, salt: u64) -> u64 {
    splitmix(seed ^ splitmix((rank as u64) << 8 ^ salt))
}

/// Deterministic `f32` data of `rank`: `len` values in `[-1, 1)` times a per-rank
/// magnitude in `[0.5, 2)`.
pub fn rank_data(seed: u64, rank: usize, len: usize) -> Vec<f32> {
    let k = key(seed, rank, 1);
    let mag = 0.5 + 1.5 * ((k >> 40) as f32 / (1u64 << 24) as f32);
    (0..len as u64)
        .map(|i| {
            let v = splitmix(k ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03));
            ((v >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * mag
        })
        .collect()
}

/// Deterministic bytes of `rank`.
pub fn rank_bytes(seed: u64, rank: usize, len: usize) -> Vec<u8> {
    let k = key(seed, rank, 2);
    (0..len as u64).map(|i| (splitmix(k ^ i) >> 56) as u8).collect()
}

pub(super) fn err(what: &str, e: CommError) -> String {
    format!("{what}: {e}")
}

pub(super) fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Result<(), String> {
    if cond { Ok(()) } else { Err(msg()) }
}

/// The groups every check runs on, for `rank`: the world, the world in reverse
/// order, its node, its rail, and its hpZ pair (when the node size is even).
pub fn groups(topology: &Topology, rank: usize) -> Vec<Group> {
    let mut v = vec![
        Group::world(topology),
        Group::world(topology).reversed(),
        Group::intra_node(topology, rank),
        Group::rail(topology, rank),
    ];
    if topology.local_size().is_multiple_of(2)
        && let Ok(g) = Group::hpz(topology, rank, 2)
    {
        v.push(g);
    }
    v
}

/// Exact sum in group order, as the primitives compute it.
pub(super) fn ordered_sum(parts: impl Iterator<Item = f32>) -> f32 {
    parts.fold(0.0f32, |a, b| a + b)
}

/// The reduction's last step on a sum over `g` ranks: the mean divides by `g`.
pub(super) fn finish(sum: f32, reduce: Reduce, g: usize) -> f32 {
    if reduce == Reduce::Mean && g > 1 { sum / g as f32 } else { sum }
}

/// `x` after a trip over the wire as `wire`.
pub(super) fn on_wire(wire: DenseWire, x: f32) -> f32 {
    match wire {
        DenseWire::Bf16 => bf16::from_f32(x).to_f32(),
        DenseWire::F32 => x,
    }
}

/// Runs `check(comm, group, seed)` on every group of [`groups`], the `i`-th with
/// `seed + i`.
pub(super) fn each_group<C: Communicator + ?Sized>(
    comm: &mut C,
    seed: u64,
    mut check: impl FnMut(&mut C, &Group, u64) -> Result<(), String>,
) -> Result<(), String> {
    let topo = *comm.topology();
    for (gi, group) in groups(&topo, comm.rank()).iter().enumerate() {
        check(comm, group, seed + gi as u64)?;
    }
    Ok(())
}
