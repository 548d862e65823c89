//! qgZ's checks: its analytic error bound ([`qgz_error_bound`]), qgZ within it
//! on either implementation, and the ring-quantized baseline within a loose bound.

use zeropp_quant::{Bits, QuantSpec};

use crate::collectives::{QgzOptions, Reduce, RingOptions, ring_quantized_reduce_scatter, shard_len};
use crate::{Communicator, Group, Topology};

use super::common::*;
use super::paths::Collectives;

/// Per-element analytic error bound of qgZ against the exact mean (or sum).
///
/// Every quantization of a block with maximum magnitude `amax` errs by at most one
/// step `amax / 2^(b-1)` (the clipped group maximum). For target shard `(mt, lt)`:
/// every contribution is quantized once at the first hop (with
/// [`QgzOptions::local_spec`] for ranks with local rank `lt`, whose chunk stays
/// local, else the intra spec; with the inter spec when `L = 1`, where the own
/// shard is exact), and the partial sum of every node `m ≠ mt` is requantized at
/// the second hop (bounded by its members' amax over the shard plus their first-hop
/// error). `inputs[r]` is rank `r`'s full gradient; the bound is returned for the
/// `⌈n/W⌉` elements of shard `shard` (the output of rank `shard`).
///
/// With [`QgzOptions::hadamard`], a whole group `B` of `g` elements is quantized
/// in the rotated basis, where no value exceeds `‖x_B‖₂` (the rotation is
/// orthonormal): the same sum, with `‖x_B‖₂` for the amax, bounds each rotated
/// error, and rotating back multiplies an elementwise bound by at most `√g`
/// (`|(R⁻¹e)_i| ≤ Σ|e_j|/√g`). A partial last group is not rotated.
pub fn qgz_error_bound(
    topology: &Topology,
    inputs: &[Vec<f32>],
    opts: &QgzOptions,
    shard: usize,
) -> Vec<f32> {
    let (w, nodes, local) = (topology.world(), topology.nodes(), topology.local_size());
    let (mt, lt) = (topology.node_of(shard), topology.local_rank(shard));
    let n = inputs.first().map_or(0, Vec::len);
    let s = shard_len(n, w);
    let step = |spec: &QuantSpec| 1.0 / f64::from(1u32 << (spec.bits().bits() - 1));
    let get = |x: &Vec<f32>, i: usize| f64::from(x.get(i).copied().unwrap_or(0.0)).abs();
    // The quantization block (of size gs, aligned at the shard start) containing element i.
    let block = |i: usize, gs: usize| {
        let (part, k) = (i / s.max(1), i % s.max(1));
        let lo = part * s + (k / gs) * gs;
        (lo, (lo + gs).min(part * s + s))
    };
    let g = opts.intra_spec.group_size();
    // Whether element i sits in a rotated (whole) group.
    let rotated = |i: usize| {
        let (lo, hi) = block(i, g);
        opts.hadamard.is_some() && hi - lo == g
    };
    // The largest value the quantizer sees in i's block: amax, or ‖x_B‖₂ when rotated.
    let block_max = |x: &Vec<f32>, i: usize, gs: usize| {
        let (lo, hi) = block(i, gs);
        if rotated(i) {
            (lo..hi).map(|j| get(x, j).powi(2)).sum::<f64>().sqrt()
        } else {
            (lo..hi).map(|j| get(x, j)).fold(0.0f64, f64::max)
        }
    };
    let scale = if opts.reduce == Reduce::Mean { 1.0 / w as f64 } else { 1.0 };
    let shard_amax: Vec<f64> =
        inputs.iter().map(|x| (shard * s..(shard + 1) * s).map(|j| get(x, j)).fold(0.0, f64::max)).collect();
    (shard * s..(shard + 1) * s)
        .map(|i| {
            if w == 1 {
                return 0.0;
            }
            let rot = rotated(i);
            let mut e = 0.0f64;
            let mut total_amax = 0.0f64;
            for m in 0..nodes {
                let mut partial_amax = 0.0f64;
                for l in 0..local {
                    let r = topology.rank_of(m, l);
                    let x = &inputs[r];
                    total_amax += shard_amax[r];
                    let spec = if local == 1 {
                        if m == mt {
                            continue;
                        }
                        &opts.inter_spec
                    } else if l == lt {
                        &opts.local_spec
                    } else {
                        &opts.intra_spec
                    };
                    let e1 = step(spec);
                    e += block_max(x, i, spec.group_size()) * e1;
                    partial_amax += if rot {
                        block_max(x, i, g) * (1.0 + e1 * (g as f64).sqrt())
                    } else {
                        shard_amax[r] * (1.0 + e1)
                    };
                }
                if nodes > 1 && local > 1 && m != mt {
                    e += partial_amax * step(&opts.inter_spec);
                }
            }
            if rot {
                e *= (g as f64).sqrt();
            }
            ((e + 1e-5 * total_amax + 1e-30) * scale) as f32
        })
        .collect()
}

/// qgZ over the world (sum and mean, one and two levels, with and without the
/// Hadamard rotation): within [`qgz_error_bound`] of the exact f64 result.
pub fn check_qgz<X: Collectives + ?Sized>(x: &mut X, case: &Case) -> Result<(), String> {
    let topo = x.topology();
    let w = topo.world();
    let rank = x.rank();
    let n = case.len;
    let s = shard_len(n, w);
    let seed = case.seed + 700;
    let inputs: Vec<Vec<f32>> = (0..w).map(|r| rank_data(seed, r, n)).collect();
    for (oi, opts) in [
        QgzOptions::default(),
        QgzOptions::default().sum(),
        QgzOptions::default().with_spec(
            QuantSpec::new(Bits::Int8, zeropp_quant::Scheme::Symmetric, 5).map_err(|e| e.to_string())?,
        ),
        // SDP4Bit's two levels with the Hadamard rotation (groups of 8, so short
        // shards hold whole, rotated groups).
        QgzOptions::two_level(8).map_err(|e| e.to_string())?.with_hadamard(case.seed),
    ]
    .iter()
    .enumerate()
    {
        let bound = qgz_error_bound(&topo, &inputs, opts, rank);
        let mut out = vec![f32::NAN; s];
        x.qgz_reduce_scatter(&inputs[rank], &mut out, opts).map_err(|e| err("qgz_reduce_scatter", e))?;
        let scale = if opts.reduce == Reduce::Mean { 1.0 / w as f64 } else { 1.0 };
        for (k, &y) in out.iter().enumerate() {
            let i = rank * s + k;
            let exact: f64 =
                if i < n { inputs.iter().map(|x| f64::from(x[i])).sum::<f64>() * scale } else { 0.0 };
            let b = f64::from(bound[k]);
            ensure((f64::from(y) - exact).abs() <= b, || {
                format!("qgz (options #{oi}) element {i}: got {y}, exact {exact}, bound {b}")
            })?;
        }
    }
    Ok(())
}

/// The ring-quantized baseline reduce-scatter over the world: within a loose
/// bound of the exact f64 mean.
pub fn check_ring<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    let topo = *comm.topology();
    let (w, rank, n) = (topo.world(), comm.rank(), case.len);
    let s = shard_len(n, w);
    let inputs: Vec<Vec<f32>> = (0..w).map(|r| rank_data(case.seed + 700, r, n)).collect();
    let opts = RingOptions::default();
    let mut out = vec![f32::NAN; s];
    ring_quantized_reduce_scatter(comm, &Group::world(&topo), &inputs[rank], &mut out, &opts)
        .map_err(|e| err("ring_quantized_reduce_scatter", e))?;
    let amax = inputs.iter().flatten().fold(0.0f64, |a, &x| a.max(f64::from(x).abs()));
    // Hop t quantizes a partial of t+1 contributions: error <= (t+1)·amax·(1+1/8)^t / 8.
    let loose: f64 =
        (0..w.saturating_sub(1)).map(|t| (t + 1) as f64 * amax * 1.125f64.powi(t as i32) / 8.0).sum::<f64>()
            / w as f64
            + 1e-6;
    for (k, &y) in out.iter().enumerate() {
        let i = rank * s + k;
        let exact: f64 =
            if i < n { inputs.iter().map(|x| f64::from(x[i])).sum::<f64>() / w as f64 } else { 0.0 };
        ensure((f64::from(y) - exact).abs() <= loose, || {
            format!("ring element {i}: got {y}, exact {exact}, bound {loose}")
        })?;
    }
    Ok(())
}
