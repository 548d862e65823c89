//! The checks of the ZeRO++ collectives and their baselines: dense and bf16
//! baselines, qwZ, qgZ (with its error bound), the world (routed) collectives,
//! and a duplicated communicator on a worker thread.
//!
//! The checks generic over [`Collectives`] run on the host and the device
//! implementations alike; the others check host functions that have no device
//! twin (the f32 baseline reduce-scatter, the ring baseline, qwZ's gathered
//! encodings, async jobs).

use half::bf16;
use zeropp_quant::{Bits, QuantSpec, dequantize, encoded_len, quantize, quantize_to_wire};

use crate::collectives::{
    DenseWire, QgzOptions, QwzOptions, Reduce, RingOptions, Routing, dequantize_encodings, reduce_scatter,
    ring_quantized_reduce_scatter, shard_len, world_qwz_gather_encoded,
};
use crate::{AsyncComm, CommExt, Communicator, Group, Topology};

use super::common::*;
use super::paths::Collectives;

/// One group of the baseline checks (the world, then the node): every
/// member's input, this rank's index in the group and the shard length.
struct BaselineGroup {
    group: Group,
    seed: u64,
    inputs: Vec<Vec<f32>>,
    me: usize,
    s: usize,
}

impl BaselineGroup {
    fn all(topo: &Topology, rank: usize, case: &Case) -> Vec<Self> {
        [Group::world(topo), Group::intra_node(topo, rank)]
            .into_iter()
            .enumerate()
            .map(|(gi, group)| {
                let seed = case.seed + 500 + gi as u64;
                let inputs = group.ranks().iter().map(|&r| rank_data(seed, r, case.len)).collect();
                let (me, s) = (group.index_of(rank).unwrap_or(0), shard_len(case.len, group.size()));
                Self { group, seed, inputs, me, s }
            })
            .collect()
    }

    /// Element `k` of this rank's shard in member `x`'s input (0 past the end).
    fn at(&self, x: &[f32], k: usize) -> f32 {
        x.get(self.me * self.s + k).copied().unwrap_or(0.0)
    }
}

/// The f32 ZeRO-3 baseline reduce-scatter (sum and mean), on the world and the
/// node group.
pub fn check_baselines<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    let topo = *comm.topology();
    for b in BaselineGroup::all(&topo, comm.rank(), case) {
        let BaselineGroup { group, inputs, me, s, .. } = &b;
        let (g, s, me) = (group.size(), *s, *me);
        let at = |x: &Vec<f32>, k: usize| b.at(x, k);
        for reduce in [Reduce::Sum, Reduce::Mean] {
            let mut out = vec![f32::NAN; s];
            reduce_scatter(comm, group, &inputs[me], &mut out, reduce)
                .map_err(|e| err("reduce_scatter", e))?;
            let expect: Vec<f32> =
                (0..s).map(|k| finish(ordered_sum(inputs.iter().map(|x| at(x, k))), reduce, g)).collect();
            ensure(out == expect, || {
                format!("reduce_scatter {reduce:?} on {:?}: wrong result", group.ranks())
            })?;
        }
    }
    Ok(())
}

/// The bf16-wire ZeRO-3 baselines: the reduce-scatter (sum and mean) and the
/// all-gather, on the world and the node group.
pub fn check_bf16_baselines<X: Collectives + ?Sized>(x: &mut X, case: &Case) -> Result<(), String> {
    let (topo, rank, n) = (x.topology(), x.rank(), case.len);
    for b in BaselineGroup::all(&topo, rank, case) {
        let BaselineGroup { group, seed, inputs, me, s } = &b;
        let (g, s, me, seed) = (group.size(), *s, *me, *seed);
        let at = |x: &Vec<f32>, k: usize| b.at(x, k);
        for reduce in [Reduce::Sum, Reduce::Mean] {
            let mut out = vec![f32::NAN; s];
            x.reduce_scatter_bf16_wire(group, &inputs[me], &mut out, reduce)
                .map_err(|e| err("reduce_scatter_bf16_wire", e))?;
            let expect: Vec<f32> = (0..s)
                .map(|k| {
                    if me * s + k >= n {
                        return 0.0;
                    }
                    finish(ordered_sum(inputs.iter().map(|x| bf16::from_f32(at(x, k)).to_f32())), reduce, g)
                })
                .collect();
            ensure(out == expect, || {
                format!("reduce_scatter_bf16_wire {reduce:?} on {:?}: wrong result", group.ranks())
            })?;
        }
        let mine = rank_data(seed, rank, n);
        let mut full = vec![0f32; n * g];
        x.all_gather_via_bf16(group, &mine, &mut full).map_err(|e| err("all_gather_f32_via_bf16", e))?;
        let expect: Vec<f32> = inputs.iter().flatten().map(|&v| bf16::from_f32(v).to_f32()).collect();
        ensure(full == expect, || format!("all_gather_f32_via_bf16 on {:?}: wrong result", group.ranks()))?;
    }
    Ok(())
}

/// The local reference of qwZ on `group`: every member's shard quantized and
/// dequantized.
fn qwz_reference(group: &Group, seed: u64, len: usize, o: &QwzOptions) -> Result<Vec<f32>, String> {
    let mut expect = Vec::with_capacity(len * group.size());
    for &r in group.ranks() {
        let q = quantize(&rank_data(seed, r, len), o.spec, &o.quant).map_err(|e| e.to_string())?;
        expect.extend(dequantize(&q, &o.quant).map_err(|e| e.to_string())?);
    }
    Ok(expect)
}

/// The qwZ options the checks use: INT8 in groups of 2048, and INT4 in groups of 7.
fn qwz_options() -> Result<[QwzOptions; 2], String> {
    Ok([QwzOptions::default(), QwzOptions::with_spec(QuantSpec::int4(7).map_err(|e| e.to_string())?)])
}

/// qwZ on the world, the node and the hpZ groups into f32; the result must
/// equal a local quantize/dequantize of every member's shard, bit for bit.
pub fn check_qwz<X: Collectives + ?Sized>(x: &mut X, case: &Case) -> Result<(), String> {
    let topo = x.topology();
    let rank = x.rank();
    for (gi, group) in groups(&topo, rank).iter().enumerate() {
        for o in &qwz_options()? {
            let seed = case.seed + 600 + gi as u64;
            let mine = rank_data(seed, rank, case.len);
            let mut full = vec![0f32; case.len * group.size()];
            x.qwz_all_gather(group, &mine, &mut full, o).map_err(|e| err("qwz_all_gather", e))?;
            let expect = qwz_reference(group, seed, case.len, o)?;
            ensure(full == expect, || {
                format!("qwz_all_gather on {:?}: differs from the local reference", group.ranks())
            })?;
        }
    }
    Ok(())
}

/// qwZ into bf16 on the world, the node and the hpZ groups: the local
/// reference rounded to bf16.
pub fn check_qwz_bf16<X: Collectives + ?Sized>(x: &mut X, case: &Case) -> Result<(), String> {
    let topo = x.topology();
    let rank = x.rank();
    for (gi, group) in groups(&topo, rank).iter().enumerate() {
        for o in &qwz_options()? {
            let seed = case.seed + 600 + gi as u64;
            let g = group.size();
            let mine = rank_data(seed, rank, case.len);
            let expect = qwz_reference(group, seed, case.len, o)?;
            let mut full16 = vec![bf16::ZERO; case.len * g];
            x.qwz_all_gather_bf16(group, &mine, &mut full16, o)
                .map_err(|e| err("qwz_all_gather(bf16)", e))?;
            ensure(
                full16.iter().zip(&expect).all(|(a, b)| a.to_bits() == bf16::from_f32(*b).to_bits()),
                || "qwz_all_gather to bf16: wrong result".into(),
            )?;
        }
    }
    Ok(())
}

/// What [`world_reduce_scatter`] must return, bit for bit, for element `i` (of
/// shard `t = (mt, lt)`) given every rank's input, computed sequentially from the
/// definition of each routing. Flat: the sum of the `W` (wire-rounded) inputs in
/// rank order. Hierarchical: node `m'`'s partial is the sum over local ranks `j` in
/// order of `(m', j)`'s input, wire-rounded unless `j == lt` (`L > 1`; for `L = 1`
/// the input itself); the result is the sum over nodes in order of the partials,
/// wire-rounded unless `m' == mt` (`N > 1`; for `N = 1` the one partial).
fn world_reduce_reference(
    topology: &Topology,
    inputs: &[Vec<f32>],
    routing: Routing,
    wire: DenseWire,
    reduce: Reduce,
    t: usize,
    i: usize,
) -> f32 {
    let (w, nodes, local) = (topology.world(), topology.nodes(), topology.local_size());
    let x = |r: usize| inputs.get(r).and_then(|v| v.get(i)).copied().unwrap_or(0.0);
    let sum = match routing {
        Routing::Flat => ordered_sum((0..w).map(|r| on_wire(wire, x(r)))),
        Routing::Hierarchical => {
            let (mt, lt) = (topology.node_of(t), topology.local_rank(t));
            let partial = |m: usize| {
                if local == 1 {
                    x(topology.rank_of(m, 0))
                } else {
                    ordered_sum((0..local).map(|j| {
                        let v = x(topology.rank_of(m, j));
                        if j == lt { v } else { on_wire(wire, v) }
                    }))
                }
            };
            if nodes == 1 {
                partial(0)
            } else {
                ordered_sum((0..nodes).map(|m| if m == mt { partial(m) } else { on_wire(wire, partial(m)) }))
            }
        }
    };
    finish(sum, reduce, w)
}

/// Every rank's shard of the world checks, and qwZ's reference encodings and
/// gather of them for options `o`.
fn world_qwz_reference(shards: &[Vec<f32>], o: &QwzOptions) -> Result<(Vec<u8>, Vec<f32>), String> {
    let c = shards.first().map_or(0, Vec::len);
    let e = encoded_len(o.spec, c);
    let mut expect_enc = vec![0u8; e * shards.len()];
    let mut expect_full = Vec::with_capacity(c * shards.len());
    for (r, x) in shards.iter().enumerate() {
        quantize_to_wire(x, o.spec, &o.quant, &mut expect_enc[r * e..(r + 1) * e])
            .map_err(|e| e.to_string())?;
        let q = quantize(x, o.spec, &o.quant).map_err(|e| e.to_string())?;
        expect_full.extend(dequantize(&q, &o.quant).map_err(|e| e.to_string())?);
    }
    Ok((expect_enc, expect_full))
}

/// The world collectives with both [`Routing`]s and both [`DenseWire`] types:
/// dense all-gathers equal the wire-rounded inputs bit for bit; qwZ's gather
/// equals a local dequantization, bit for bit; reduce-scatters (sum and mean)
/// equal the sequential reference of their routing
/// ([`world_reduce_scatter`](crate::collectives::world_reduce_scatter)'s
/// documented summation order) bit for bit.
pub fn check_world_collectives<X: Collectives + ?Sized>(x: &mut X, case: &Case) -> Result<(), String> {
    let topo = x.topology();
    let (w, rank, c) = (topo.world(), x.rank(), case.len);
    let seed = case.seed + 900;
    let shards: Vec<Vec<f32>> = (0..w).map(|r| rank_data(seed, r, c)).collect();
    for routing in Routing::ALL {
        for wire in DenseWire::ALL {
            let mut full = vec![f32::NAN; c * w];
            x.world_all_gather(routing, wire, &shards[rank], &mut full)
                .map_err(|e| err("world_all_gather", e))?;
            let expect = shards.iter().flatten().map(|&x| on_wire(wire, x));
            ensure(full.iter().zip(expect).all(|(a, b)| a.to_bits() == b.to_bits()), || {
                format!("world_all_gather {routing} {wire}: wrong result")
            })?;
        }
    }

    for o in qwz_options()? {
        let (_, expect_full) = world_qwz_reference(&shards, &o)?;
        for routing in Routing::ALL {
            let mut full = vec![f32::NAN; c * w];
            x.world_qwz_all_gather(routing, &shards[rank], &mut full, &o)
                .map_err(|e| err("world_qwz_all_gather", e))?;
            ensure(full.iter().zip(&expect_full).all(|(a, b)| a.to_bits() == b.to_bits()), || {
                format!("world_qwz_all_gather {routing}: differs from the local reference")
            })?;
        }
    }

    let n = case.len;
    let s = shard_len(n, w);
    let inputs: Vec<Vec<f32>> = (0..w).map(|r| rank_data(seed + 1, r, n)).collect();
    for routing in Routing::ALL {
        for wire in DenseWire::ALL {
            for reduce in [Reduce::Sum, Reduce::Mean] {
                let mut out = vec![f32::NAN; s];
                x.world_reduce_scatter(routing, wire, &inputs[rank], &mut out, reduce)
                    .map_err(|e| err("world_reduce_scatter", e))?;
                for (k, &y) in out.iter().enumerate() {
                    let i = rank * s + k;
                    let expect = if i < n {
                        world_reduce_reference(&topo, &inputs, routing, wire, reduce, rank, i)
                    } else {
                        0.0
                    };
                    ensure(y == expect, || {
                        format!(
                            "world_reduce_scatter {routing} {wire} {reduce:?} element {i}: got {y}, expected {expect}"
                        )
                    })?;
                }
            }
        }
    }
    Ok(())
}

/// qwZ's world gather of encodings (a host function): the encodings equal every
/// rank's local `quantize_to_wire`, byte for byte, with either [`Routing`], and
/// [`dequantize_encodings`] of any suffix of them a local dequantization, bit
/// for bit.
pub fn check_world_qwz_encodings<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    let topo = *comm.topology();
    let (w, rank, c) = (topo.world(), comm.rank(), case.len);
    let shards: Vec<Vec<f32>> = (0..w).map(|r| rank_data(case.seed + 900, r, c)).collect();
    for o in qwz_options()? {
        let e = encoded_len(o.spec, c);
        let (expect_enc, expect_full) = world_qwz_reference(&shards, &o)?;
        for routing in Routing::ALL {
            let enc = world_qwz_gather_encoded(comm, routing, &shards[rank], &o)
                .map_err(|e| err("world_qwz_gather_encoded", e))?;
            ensure(enc == expect_enc, || format!("world_qwz_gather_encoded {routing}: wrong bytes"))?;
            // The encodings of ranks rank..W (a suffix, as the engine keeps a range).
            let mut part = vec![f32::NAN; c * (w - rank)];
            dequantize_encodings(&enc[rank * e..], c, &mut part, &o.quant)
                .map_err(|e| err("dequantize_encodings", e))?;
            ensure(
                part.iter().zip(&expect_full[rank * c..]).all(|(a, b)| a.to_bits() == b.to_bits()),
                || format!("dequantize_encodings of ranks {rank}..{w}: wrong result"),
            )?;
        }
    }
    Ok(())
}

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

/// `duplicate` gives an independent stream, and [`AsyncComm`] jobs on it complete
/// while the main stream runs its own collectives.
pub fn check_duplicate_async<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    let topo = *comm.topology();
    let rank = comm.rank();
    let world = Group::world(&topo);
    let seed = case.seed + 800;
    let worker = AsyncComm::duplicate_from(comm).map_err(|e| err("duplicate", e))?;
    let (g2, len) = (world.clone(), case.len);
    let pending = worker.submit(move |c| {
        let mut all = vec![0f32; len * g2.size()];
        c.all_gather(&g2, &rank_data(seed, rank, len), &mut all)?;
        Ok(all)
    });
    // Meanwhile, a collective on the main stream.
    let mut x = [1.0f32];
    comm.all_reduce_f32(&world, &mut x).map_err(|e| err("all_reduce on the main stream", e))?;
    let all = pending.wait().map_err(|e| err("async all_gather", e))?;
    let expect: Vec<f32> = (0..topo.world()).flat_map(|r| rank_data(seed, r, len)).collect();
    ensure(all == expect && x[0] == topo.world() as f32, || {
        "async all_gather on a duplicate: wrong result".into()
    })?;
    worker.shutdown().map_err(|e| err("shutdown", e))
}
