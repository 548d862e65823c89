//! The checks of the ZeRO++ collectives and their baselines: dense and bf16
//! baselines, qwZ, the world (routed) collectives, and a duplicated
//! communicator on a worker thread (qgZ's are in `qgz.rs`).
//!
//! The checks generic over [`Collectives`] run on the host and the device
//! implementations alike; the others check host functions that have no device
//! twin (the f32 baseline reduce-scatter, qwZ's gathered encodings, async jobs).

use half::bf16;
use zeropp_quant::{QuantSpec, dequantize, encoded_len, quantize, quantize_to_wire};

use crate::collectives::{
    DenseWire, QwzOptions, Reduce, Routing, dequantize_encodings, reduce_scatter, shard_len,
    world_qwz_gather_encoded,
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
