//! The ZeRO-3 baselines and the ZeRO++ collectives, written once on the
//! [`crate::Communicator`] primitives and generic over
//! `C: Communicator + ?Sized` (so they also run on `dyn Communicator`, e.g. inside
//! [`AsyncComm`](crate::AsyncComm) jobs, and on every backend).
//!
//! # Shards and padding
//!
//! A full tensor of `n` elements reduce-scattered over `p` parts is padded with
//! zeros to `p·s` elements, `s = ⌈n/p⌉` ([`shard_len`]); part `i` owns the
//! contiguous elements `[i·s, (i+1)·s)` ([`shard_range`] clips that to `n`). Every
//! reduce-scatter here writes an output shard of exactly `s` elements; the entries
//! past `n` (only in the last parts) are set to 0. Gathers take a shard of any
//! length `c` and write `c·g` elements, the shard of member `j` at `[j·c, (j+1)·c)`.
//!
//! # qgZ steps
//!
//! For `N` nodes × `L` ranks per node, rank `(m, l)` receives shard `m·L + l`:
//! (1) slice reordering, fused into quantization: the chunk for local peer `j`
//! holds the shards of ranks `(m', j)`, `m' = 0..N`, each its own wire encoding;
//! (2) intra-node all-to-all (INT4); (3) fused dequantize + sum + requantize of the
//! `L` encodings of each shard `(m', l)`; (4) inter-node all-to-all (INT4) over
//! [`Group::rail`](crate::Group::rail); (5) dequantize + sum, divide by `W`. A
//! rank's own chunk never travels and is kept in [`QgzOptions::local_spec`]
//! (INT8), and the own node's partial is summed in f32 rather than requantized.
//! `N = 1` skips step 4, `L = 1` skips steps 2-3 (the own shard is exact), `W = 1`
//! copies. Optional error feedback ([`qgz_reduce_scatter_with_feedback`]) keeps the
//! first hop's quantization residual and adds it to the next call's gradient.
//!
//! # Routing
//!
//! The `world_*` collectives ([`world_all_gather`], [`world_reduce_scatter`],
//! [`world_qwz_all_gather`]) run over the whole world with a [`Routing`]: flat
//! (every rank with every rank, the group baselines on [`Group::world`]) or
//! hierarchical (an inter-node hop over [`Group::rail`] and an intra-node hop over
//! [`Group::intra_node`], as NCCL and torch HSDP route), which sends each byte
//! across nodes once per node instead of once per rank. Hierarchical gathers are
//! bit-identical to flat ones; the hierarchical reduce-scatter sums in a different
//! order (local ranks, then nodes) and, on a bf16 wire, rounds twice (contributions,
//! then node partials).
//!
//! # Traffic formulas (bytes sent by one rank, per collective)
//!
//! `g` is the group size; `E(spec, k)` = [`quant::encoded_len`](crate::quant::encoded_len)`(spec, k)`
//! `= 32 + 4·⌈k/group_size⌉·(1, or 2 if asymmetric) + (k, or ⌈k/2⌉ for INT4)`
//! is the wire size of `k` quantized elements (header, scales, offsets, data). For
//! qgZ on `N` nodes × `L` ranks per node, `W = N·L`, `s = ⌈n/W⌉`.
//!
//! | collective | intra/inter split | bytes sent per rank |
//! |---|---|---|
//! | [`all_gather_f32`] (shard `c`) | by peer | `4c` to each of the `g-1` others |
//! | [`all_gather_bf16`], [`all_gather_f32_via_bf16`] | by peer | `2c` to each other member |
//! | [`reduce_scatter`] (full `n`, `s = ⌈n/g⌉`) | by peer | `4s` to each other member |
//! | [`dense_reduce_scatter`] (bf16 wire) | by peer | `2s` to each other member |
//! | [`qwz_all_gather`] (shard `c`) | by peer | `E(spec, c)` to each other member (one message: data + scales + header) |
//! | [`qgz_reduce_scatter`], hop 1 (`L > 1`) | intra only | `N·E(intra_spec, s)` to each of the `L-1` local peers |
//! | [`qgz_reduce_scatter`], hop 2 (`N > 1`) | inter only | `E(inter_spec, s)` to each of the `N-1` rail peers |
//! | [`ring_quantized_reduce_scatter`] | by peer | `(g-1)·E(spec, s)` to the next member, in `g-1` steps; each step is an all-to-all-v that also sends `0`-byte messages to the `g-2` others |
//!
//! The world collectives with a [`Routing`] (over all `W = N·L` ranks; `b` =
//! [`DenseWire::bytes`], shard `c`, full `n`, `s = ⌈n/W⌉`, `E = E(spec, c)`), each
//! with its formula function returning [`LinkBytes`](crate::LinkBytes):
//!
//! | collective | routing | intra-node bytes per rank | inter-node bytes per rank |
//! |---|---|---|---|
//! | [`world_all_gather`] ([`world_all_gather_bytes`]) | flat | `(L-1)·c·b` | `(W-L)·c·b` |
//! | | hierarchical | `(L-1)·N·c·b` (node hop: `L-1` messages of `N·c·b`) | `(N-1)·c·b` (rail hop) |
//! | [`world_reduce_scatter`] ([`world_reduce_scatter_bytes`]) | flat | `(L-1)·s·b` | `(W-L)·s·b` |
//! | | hierarchical | `(L-1)·N·s·b` (hop 1: `L-1` messages of `N·s·b`) | `(N-1)·s·b` (hop 2) |
//! | [`world_qwz_all_gather`], [`world_qwz_gather_encoded`] ([`world_qwz_bytes`]) | flat | `(L-1)·E` | `(W-L)·E` |
//! | | hierarchical | `(L-1)·N·E` | `(N-1)·E` |
//!
//! qwZ-Δ's exchange ([`qwz_delta_exchange`], [`qwz_delta_bytes`]; hpZ groups of
//! `H` ranks, `E` the encoding of one shard's difference): `E` across nodes to
//! each of the `N-1` other nodes (to the holder of the shard there), `E` to each
//! other holder in the own node (`L/H` of them, the sender possibly among them),
//! and with `H < L` a forwarding hop inside each node.
//!
//! The group collectives' formulas are [`group_all_gather_bytes`],
//! [`group_reduce_scatter_bytes`] and [`group_qwz_bytes`].
//!
//! So with `M = 2n` bytes (the model at 16 bits): qgZ puts `(L-1)·N·E(s) ≈ M/4`
//! on intra-node links and `(N-1)·E(s) ≈ M/(4L)` on inter-node links per rank,
//! against `(W-L)·2s ≈ M·(N-1)/N` inter-node bytes for the flat 16-bit baseline
//! and `(N-1)·2s ≈ M·(N-1)/W` for the hierarchical one (NCCL/HSDP routing), whose
//! intra-node bytes grow to `(L-1)·N·2s ≈ M·(L-1)/L`. Each
//! message also counts as one message in [`LinkCounters`](crate::LinkCounters); the
//! group primitives' own formulas are in [`threads`](crate::threads).

mod baseline;
mod hierarchical;
mod qgz;
mod qwz;
pub(crate) mod qwz_delta;
mod ring;
mod world_qwz;

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

pub use baseline::{
    all_gather_bf16, all_gather_f32, all_gather_f32_via_bf16, dense_reduce_scatter, group_all_gather_bytes,
    group_reduce_scatter_bytes, reduce_scatter,
};
pub use hierarchical::{
    world_all_gather, world_all_gather_bytes, world_reduce_scatter, world_reduce_scatter_bytes,
};
/// qgZ's schedule, for the device collectives that execute it too.
pub(crate) use qgz::schedule as qgz_schedule;
pub use qgz::{
    ErrorFeedback, LocoConfig, PartFn, PartSource, QgzConfig, QgzOptions, QgzSeeds, QgzStages,
    ResidualPrecision, qgz_bytes, qgz_reduce_scatter, qgz_reduce_scatter_with_feedback,
};
pub use qwz::{QwzOptions, group_qwz_bytes, qwz_all_gather};
pub use qwz_delta::{
    DeltaOptions, delta_apply, delta_apply_timed, delta_encode, qwz_delta_bytes, qwz_delta_exchange,
};
pub use ring::{RingOptions, ring_quantized_reduce_scatter};
pub use world_qwz::{dequantize_encodings, world_qwz_all_gather, world_qwz_bytes, world_qwz_gather_encoded};

use crate::{CommError, Communicator, Group, slices};

/// The quantization group size (elements per scale) of the default qwZ and qgZ
/// formats, [`QwzOptions::default`] and [`QgzOptions::default`]; the engine's
/// default too.
///
/// ```
/// use zeropp_comm::collectives::{DEFAULT_GROUP_SIZE, QgzOptions, QwzOptions};
/// assert_eq!(DEFAULT_GROUP_SIZE, 256);
/// assert_eq!(QwzOptions::default().spec.group_size(), DEFAULT_GROUP_SIZE);
/// let q = QgzOptions::default();
/// for spec in [q.intra_spec, q.inter_spec, q.local_spec] {
///     assert_eq!(spec.group_size(), DEFAULT_GROUP_SIZE);
/// }
/// ```
pub const DEFAULT_GROUP_SIZE: usize = 256;

/// `ALL`, `name`, [`fmt::Display`] and [`FromStr`] (case-insensitive, trimmed) of
/// a fieldless option enum, from its variants and their names; `$what` names the
/// type in the parse error.
macro_rules! named {
    ($ty:ident, $what:literal, [$($v:ident => $name:literal),+ $(,)?]) => {
        impl $ty {
            /// Every variant, in declaration order.
            pub const ALL: [$ty; [$($name),+].len()] = [$($ty::$v),+];

            #[doc = concat!("The name [`FromStr`] accepts: ", $("`", $name, "` "),+, "(in that order).")]
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$v => $name),+
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }

        impl FromStr for $ty {
            type Err = CommError;

            fn from_str(s: &str) -> Result<Self, CommError> {
                let key = s.trim().to_ascii_lowercase();
                $ty::ALL.into_iter().find(|v| v.name() == key).ok_or_else(|| {
                    let names: Vec<String> = $ty::ALL.iter().map(|v| format!("`{v}`")).collect();
                    CommError::InvalidConfig(format!("unknown {} {s:?}: expected {}", $what, names.join(" or ")))
                })
            }
        }
    };
}

/// How a world collective is routed over the topology.
///
/// ```
/// use zeropp_comm::collectives::Routing;
/// assert_eq!("flat".parse::<Routing>()?, Routing::Flat);
/// assert_eq!(Routing::default().name(), "hierarchical");
/// assert!("ring".parse::<Routing>().is_err());
/// # Ok::<(), zeropp_comm::CommError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Routing {
    /// Every rank exchanges directly with every rank: `(N-1)/N` of the data a rank
    /// sends crosses nodes.
    Flat,
    /// The inter-node hop goes over the rail ([`Group::rail`]), the intra-node hop
    /// over the node ([`Group::intra_node`]), as NCCL and torch HSDP route.
    #[default]
    Hierarchical,
}

named!(Routing, "routing", [Flat => "flat", Hierarchical => "hierarchical"]);

/// Element type of the dense (baseline) collectives on the wire.
///
/// ```
/// use zeropp_comm::collectives::DenseWire;
/// assert_eq!("f32".parse::<DenseWire>()?.bytes(), 4);
/// assert_eq!(DenseWire::default().bytes(), 2);
/// assert_eq!(DenseWire::Bf16.name(), "bf16");
/// assert!("fp8".parse::<DenseWire>().is_err());
/// # Ok::<(), zeropp_comm::CommError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DenseWire {
    /// bf16, rounded to nearest even (the 16-bit ZeRO-3 baseline).
    #[default]
    Bf16,
    /// f32, exact.
    F32,
}

impl DenseWire {
    /// Bytes per element on the wire (2 or 4).
    pub fn bytes(self) -> usize {
        match self {
            DenseWire::Bf16 => 2,
            DenseWire::F32 => 4,
        }
    }
}

named!(DenseWire, "dense wire type", [Bf16 => "bf16", F32 => "f32"]);

/// How a reduce-scatter combines the ranks' contributions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduce {
    /// The element-wise sum.
    Sum,
    /// The element-wise mean (the sum divided by the number of ranks): gradient averaging.
    #[default]
    Mean,
}

/// Elements per part when `n` elements are split into `parts` equal padded parts: `⌈n/parts⌉`.
pub fn shard_len(n: usize, parts: usize) -> usize {
    if parts == 0 { 0 } else { n.div_ceil(parts) }
}

/// The real (unpadded) elements of part `index`: `[index·s, (index+1)·s) ∩ [0, n)`.
///
/// ```
/// use zeropp_comm::collectives::{shard_len, shard_range};
/// assert_eq!(shard_len(10, 4), 3);
/// assert_eq!(shard_range(10, 4, 3), 9..10);
/// assert_eq!(shard_range(5, 4, 3), 5..5); // all padding
/// ```
pub fn shard_range(n: usize, parts: usize, index: usize) -> Range<usize> {
    let s = shard_len(n, parts);
    let lo = (index * s).min(n);
    let hi = ((index + 1) * s).min(n);
    lo..hi
}

/// A stopwatch around a collective's quantization work (quantize, dequantize,
/// the fused reduce): [`QuantClock::stop`] adds the time since
/// [`QuantClock::start`] to the communicator's [`quant_time`](crate::TrafficCounter::quant_time).
pub(crate) struct QuantClock(std::time::Instant);

impl QuantClock {
    /// Starts timing.
    pub(crate) fn start() -> Self {
        Self(std::time::Instant::now())
    }

    /// Adds the time since [`start`](Self::start) to `comm`'s quantization clock.
    pub(crate) fn stop<C: Communicator + ?Sized>(self, comm: &mut C) {
        comm.traffic_mut().add_quant_time(self.0.elapsed());
    }
}

/// The calling rank's index in `group`, or an error.
pub(crate) fn my_index<C: Communicator + ?Sized>(comm: &C, group: &Group) -> Result<usize, CommError> {
    group.index_of(comm.rank()).ok_or_else(|| {
        CommError::InvalidGroup(format!("rank {} is not a member of group {:?}", comm.rank(), group.ranks()))
    })
}

/// Checks an output shard's length.
pub(crate) fn check_shard(what: &str, n: usize, parts: usize, shard: usize) -> Result<usize, CommError> {
    let s = shard_len(n, parts);
    if shard != s {
        return Err(CommError::Mismatch(format!(
            "{what}: output shard has {shard} elements, but {n} elements over {parts} parts need {s}"
        )));
    }
    Ok(s)
}

/// Calls `f` with part `index` of `full` padded with zeros to `s` elements
/// (borrowing when no padding is needed).
pub(crate) fn with_part<R>(
    full: &[f32],
    s: usize,
    index: usize,
    f: impl FnOnce(&[f32]) -> R,
) -> Result<R, CommError> {
    // Clipped to the tensor: trailing parts are (partly or wholly) padding.
    let lo = index.saturating_mul(s).min(full.len());
    let hi = index.saturating_add(1).saturating_mul(s).min(full.len());
    let real = slices::window(full, lo, hi - lo, "part of the full tensor")?;
    Ok(if real.len() == s {
        f(real)
    } else {
        let mut padded = vec![0.0f32; s];
        slices::copy_to(&mut padded, 0, real, "padded part")?;
        f(&padded)
    })
}

/// Applies the reduction's scaling and zeroes the padding of part `index`.
///
/// The mean divides by `ranks` (`x / W`, correctly rounded), rather than
/// multiplying by a rounded `1/W`, which is off by one ulp for some `x`.
pub(crate) fn finish_shard(
    shard: &mut [f32],
    n: usize,
    parts: usize,
    index: usize,
    reduce: Reduce,
    ranks: usize,
) {
    if reduce == Reduce::Mean && ranks > 1 {
        let w = ranks as f32;
        shard.iter_mut().for_each(|x| *x /= w);
    }
    // The entries past the part's real elements (if any) are padding.
    let real = shard_range(n, parts, index).len();
    shard.iter_mut().skip(real).for_each(|x| *x = 0.0);
}
