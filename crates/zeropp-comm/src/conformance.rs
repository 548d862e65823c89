//! A backend-independent conformance suite for the primitives and collectives.
//!
//! Every rank derives its inputs from `(case.seed, rank)` with [`rank_data`], so it
//! can compute every other rank's inputs too and check its own result against a
//! sequential reference without extra communication. Every `check_*` function is
//! collective: all ranks of the world must call it with the same [`Case`]. It
//! returns `Err(description)` on a wrong result or a communication error.
//!
//! ```
//! use zeropp_comm::conformance::{Case, run_all};
//! use zeropp_comm::{ThreadCluster, ThreadOptions, Topology};
//! let cluster = ThreadCluster::new(Topology::ranks(4).per_node(2)?, ThreadOptions::default());
//! cluster.run(|comm| run_all(comm, &Case { seed: 7, len: 13 }))?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use half::bf16;
use zeropp_quant::rng::splitmix64 as splitmix;
use zeropp_quant::{Bits, QuantSpec, dequantize, encoded_len, quantize, quantize_to_wire};

use crate::collectives::{
    DenseWire, QgzOptions, QwzOptions, Reduce, RingOptions, Routing, all_gather_f32, all_gather_f32_via_bf16,
    dense_reduce_scatter, dequantize_encodings, qgz_reduce_scatter, qwz_all_gather, reduce_scatter,
    ring_quantized_reduce_scatter, shard_len, world_all_gather, world_qwz_all_gather,
    world_qwz_gather_encoded, world_reduce_scatter,
};
use crate::{AsyncComm, CommError, CommExt, Communicator, Group, Primitive, Topology};

/// One conformance case: a seed for the data and a length parameter (elements per
/// rank; 0, 1, primes and large values are all valid).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Case {
    /// Seed of every rank's data.
    pub seed: u64,
    /// Length parameter (elements per shard or per rank, depending on the check).
    pub len: usize,
}

fn key(seed: u64, rank: usize, salt: u64) -> u64 {
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

fn err(what: &str, e: CommError) -> String {
    format!("{what}: {e}")
}

fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Result<(), String> {
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
fn ordered_sum(parts: impl Iterator<Item = f32>) -> f32 {
    parts.fold(0.0f32, |a, b| a + b)
}

/// The reduction's last step on a sum over `g` ranks: the mean divides by `g`.
fn finish(sum: f32, reduce: Reduce, g: usize) -> f32 {
    if reduce == Reduce::Mean && g > 1 { sum / g as f32 } else { sum }
}

/// `x` after a trip over the wire as `wire`.
fn on_wire(wire: DenseWire, x: f32) -> f32 {
    match wire {
        DenseWire::Bf16 => bf16::from_f32(x).to_f32(),
        DenseWire::F32 => x,
    }
}

/// Runs `check(comm, group, seed)` on every group of [`groups`], the `i`-th with
/// `seed + i`.
fn each_group<C: Communicator + ?Sized>(
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

/// All-gather of bytes and of `f32` on every group of [`groups`].
pub fn check_all_gather<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    each_group(comm, case.seed, |comm, group, seed| {
        let mine = rank_bytes(seed, comm.rank(), case.len);
        let mut all = vec![0u8; case.len * group.size()];
        comm.all_gather_bytes(group, &mine, &mut all).map_err(|e| err("all_gather_bytes", e))?;
        let expect: Vec<u8> = group.ranks().iter().flat_map(|&r| rank_bytes(seed, r, case.len)).collect();
        ensure(all == expect, || format!("all_gather_bytes on group {:?}: wrong result", group.ranks()))?;
        let mine = rank_data(seed, comm.rank(), case.len);
        let mut all = vec![0f32; case.len * group.size()];
        all_gather_f32(comm, group, &mine, &mut all).map_err(|e| err("all_gather_f32", e))?;
        let expect: Vec<f32> = group.ranks().iter().flat_map(|&r| rank_data(seed, r, case.len)).collect();
        ensure(all == expect, || format!("all_gather_f32 on group {:?}: wrong result", group.ranks()))?;
        Ok(())
    })
}

/// Equal-chunk all-to-all of `u16` elements on every group.
pub fn check_all_to_all<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    each_group(comm, case.seed + 100, |comm, group, seed| {
        let g = group.size();
        let data = |r: usize| -> Vec<u16> {
            rank_bytes(seed, r, 2 * case.len * g)
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect()
        };
        let mut recv = vec![0u16; case.len * g];
        comm.all_to_all(group, &data(comm.rank()), &mut recv).map_err(|e| err("all_to_all", e))?;
        let me = group.index_of(comm.rank()).unwrap_or(0);
        let expect: Vec<u16> = group
            .ranks()
            .iter()
            .flat_map(|&r| data(r)[me * case.len..(me + 1) * case.len].to_vec())
            .collect();
        ensure(recv == expect, || format!("all_to_all on group {:?}: wrong result", group.ranks()))?;
        Ok(())
    })
}

/// Variable all-to-all with pseudo-random counts in `0..=len` per pair.
pub fn check_all_to_all_v<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    each_group(comm, case.seed + 200, |comm, group, seed| {
        let g = group.size();
        let count =
            |from: usize, to: usize| (key(seed, from * 1000 + to, 3) % (case.len as u64 + 1)) as usize;
        let me = group.index_of(comm.rank()).unwrap_or(0);
        // Member i's send buffer: for each j, count(i, j) bytes.
        let send_of = |i: usize| -> Vec<u8> {
            let total: usize = (0..g).map(|j| count(i, j)).sum();
            rank_bytes(seed, group.rank_at(i).unwrap_or(0), total)
        };
        let sc: Vec<usize> = (0..g).map(|j| count(me, j)).collect();
        let rc: Vec<usize> = (0..g).map(|j| count(j, me)).collect();
        let mut recv = vec![0u8; rc.iter().sum()];
        comm.all_to_all_v_bytes(group, &send_of(me), &sc, &mut recv, &rc)
            .map_err(|e| err("all_to_all_v", e))?;
        let mut expect = Vec::new();
        for i in 0..g {
            let s = send_of(i);
            let off: usize = (0..me).map(|j| count(i, j)).sum();
            expect.extend_from_slice(&s[off..off + count(i, me)]);
        }
        ensure(recv == expect, || format!("all_to_all_v on group {:?}: wrong result", group.ranks()))?;
        Ok(())
    })
}

/// `reduce_scatter_f32` and `all_reduce_f32` (exact: the reference sums in group order).
pub fn check_reductions<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    each_group(comm, case.seed + 300, |comm, group, seed| {
        let g = group.size();
        let me = group.index_of(comm.rank()).unwrap_or(0);
        let n = case.len;
        let inputs: Vec<Vec<f32>> = group.ranks().iter().map(|&r| rank_data(seed, r, n * g)).collect();
        let mut out = vec![0f32; n];
        comm.reduce_scatter_f32(group, &inputs[me], &mut out).map_err(|e| err("reduce_scatter_f32", e))?;
        let expect: Vec<f32> = (0..n).map(|k| ordered_sum(inputs.iter().map(|x| x[me * n + k]))).collect();
        ensure(out == expect, || format!("reduce_scatter_f32 on group {:?}: wrong result", group.ranks()))?;

        let mut buf = inputs[me][..n].to_vec();
        comm.all_reduce_f32(group, &mut buf).map_err(|e| err("all_reduce_f32", e))?;
        let expect: Vec<f32> = (0..n).map(|k| ordered_sum(inputs.iter().map(|x| x[k]))).collect();
        ensure(buf == expect, || format!("all_reduce_f32 on group {:?}: wrong result", group.ranks()))?;
        let s = comm.all_reduce_scalar_f32(group, 1.0).map_err(|e| err("all_reduce_scalar_f32", e))?;
        ensure(s == g as f32, || format!("all_reduce_scalar_f32 gave {s}, expected {g}"))?;
        Ok(())
    })
}

/// Broadcast from every root index, and barriers, on every group.
pub fn check_broadcast_barrier<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    each_group(comm, case.seed + 400, |comm, group, seed| {
        for root in 0..group.size() {
            let root_rank = group.rank_at(root).unwrap_or(0);
            let mut buf = if root_rank == comm.rank() {
                rank_bytes(seed, root_rank, case.len)
            } else {
                vec![0u8; case.len]
            };
            comm.broadcast_bytes(group, root, &mut buf).map_err(|e| err("broadcast", e))?;
            ensure(buf == rank_bytes(seed, root_rank, case.len), || {
                format!("broadcast from index {root} on {:?}: wrong result", group.ranks())
            })?;
        }
        comm.barrier(group).map_err(|e| err("barrier", e))?;
        Ok(())
    })
}

/// The ZeRO-3 baselines: f32 and bf16-wire reduce-scatter (sum and mean) and the
/// bf16-wire all-gather, on the world and the node group.
pub fn check_baselines<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    let topo = *comm.topology();
    let rank = comm.rank();
    for (gi, group) in [Group::world(&topo), Group::intra_node(&topo, rank)].iter().enumerate() {
        let seed = case.seed + 500 + gi as u64;
        let g = group.size();
        let me = group.index_of(rank).unwrap_or(0);
        let n = case.len;
        let s = shard_len(n, g);
        let inputs: Vec<Vec<f32>> = group.ranks().iter().map(|&r| rank_data(seed, r, n)).collect();
        let at = |x: &Vec<f32>, k: usize| x.get(me * s + k).copied().unwrap_or(0.0);
        for reduce in [Reduce::Sum, Reduce::Mean] {
            let mut out = vec![f32::NAN; s];
            reduce_scatter(comm, group, &inputs[me], &mut out, reduce)
                .map_err(|e| err("reduce_scatter", e))?;
            let expect: Vec<f32> =
                (0..s).map(|k| finish(ordered_sum(inputs.iter().map(|x| at(x, k))), reduce, g)).collect();
            ensure(out == expect, || {
                format!("reduce_scatter {reduce:?} on {:?}: wrong result", group.ranks())
            })?;

            let mut out = vec![f32::NAN; s];
            dense_reduce_scatter(comm, group, DenseWire::Bf16, &inputs[me], &mut out, reduce)
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
        all_gather_f32_via_bf16(comm, group, &mine, &mut full)
            .map_err(|e| err("all_gather_f32_via_bf16", e))?;
        let expect: Vec<f32> = inputs.iter().flatten().map(|&x| bf16::from_f32(x).to_f32()).collect();
        ensure(full == expect, || format!("all_gather_f32_via_bf16 on {:?}: wrong result", group.ranks()))?;
    }
    Ok(())
}

/// qwZ on the world, the node and the hpZ groups, with f32 and bf16 outputs; the
/// result must equal a local quantize/dequantize of every member's shard, bit for bit.
pub fn check_qwz<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    let topo = *comm.topology();
    let rank = comm.rank();
    let opts = [QwzOptions::default(), QwzOptions::with_spec(QuantSpec::int4(7).map_err(|e| e.to_string())?)];
    for (gi, group) in groups(&topo, rank).iter().enumerate() {
        for o in &opts {
            let seed = case.seed + 600 + gi as u64;
            let g = group.size();
            let mine = rank_data(seed, rank, case.len);
            let mut full = vec![0f32; case.len * g];
            qwz_all_gather(comm, group, &mine, &mut full, o).map_err(|e| err("qwz_all_gather", e))?;
            let mut expect = Vec::with_capacity(full.len());
            for &r in group.ranks() {
                let q =
                    quantize(&rank_data(seed, r, case.len), o.spec, &o.quant).map_err(|e| e.to_string())?;
                expect.extend(dequantize(&q, &o.quant).map_err(|e| e.to_string())?);
            }
            ensure(full == expect, || {
                format!("qwz_all_gather on {:?}: differs from the local reference", group.ranks())
            })?;
            let mut full16 = vec![bf16::ZERO; case.len * g];
            qwz_all_gather(comm, group, &mine, &mut full16, o).map_err(|e| err("qwz_all_gather(bf16)", e))?;
            ensure(full16.iter().zip(&expect).all(|(a, b)| *a == bf16::from_f32(*b)), || {
                "qwz_all_gather to bf16: wrong result".into()
            })?;
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

/// The world collectives with both [`Routing`]s and both [`DenseWire`] types:
/// dense all-gathers equal the wire-rounded inputs bit for bit; qwZ's gathered
/// encodings equal every rank's local `quantize_to_wire`, byte for byte, and its
/// gather (and [`dequantize_encodings`] of any suffix) a local dequantization, bit
/// for bit; reduce-scatters (sum and mean) equal the sequential reference of their
/// routing ([`world_reduce_scatter`]'s documented summation order) bit for bit.
pub fn check_world_collectives<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    let topo = *comm.topology();
    let (w, rank, c) = (topo.world(), comm.rank(), case.len);
    let seed = case.seed + 900;
    let shards: Vec<Vec<f32>> = (0..w).map(|r| rank_data(seed, r, c)).collect();
    for routing in Routing::ALL {
        for wire in DenseWire::ALL {
            let mut full = vec![f32::NAN; c * w];
            world_all_gather(comm, routing, wire, &shards[rank], &mut full)
                .map_err(|e| err("world_all_gather", e))?;
            let expect = shards.iter().flatten().map(|&x| on_wire(wire, x));
            ensure(full.iter().zip(expect).all(|(a, b)| a.to_bits() == b.to_bits()), || {
                format!("world_all_gather {routing} {wire}: wrong result")
            })?;
        }
    }

    let int4 = QwzOptions::with_spec(QuantSpec::int4(7).map_err(|e| e.to_string())?);
    for o in [QwzOptions::default(), int4] {
        let e = encoded_len(o.spec, c);
        let mut expect_enc = vec![0u8; e * w];
        let mut expect_full = Vec::with_capacity(c * w);
        for (r, x) in shards.iter().enumerate() {
            quantize_to_wire(x, o.spec, &o.quant, &mut expect_enc[r * e..(r + 1) * e])
                .map_err(|e| e.to_string())?;
            let q = quantize(x, o.spec, &o.quant).map_err(|e| e.to_string())?;
            expect_full.extend(dequantize(&q, &o.quant).map_err(|e| e.to_string())?);
        }
        for routing in Routing::ALL {
            let enc = world_qwz_gather_encoded(comm, routing, &shards[rank], &o)
                .map_err(|e| err("world_qwz_gather_encoded", e))?;
            ensure(enc == expect_enc, || format!("world_qwz_gather_encoded {routing}: wrong bytes"))?;
            let mut full = vec![f32::NAN; c * w];
            world_qwz_all_gather(comm, routing, &shards[rank], &mut full, &o)
                .map_err(|e| err("world_qwz_all_gather", e))?;
            ensure(full.iter().zip(&expect_full).all(|(a, b)| a.to_bits() == b.to_bits()), || {
                format!("world_qwz_all_gather {routing}: differs from the local reference")
            })?;
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

    let n = case.len;
    let s = shard_len(n, w);
    let inputs: Vec<Vec<f32>> = (0..w).map(|r| rank_data(seed + 1, r, n)).collect();
    for routing in Routing::ALL {
        for wire in DenseWire::ALL {
            for reduce in [Reduce::Sum, Reduce::Mean] {
                let mut out = vec![f32::NAN; s];
                world_reduce_scatter(comm, routing, wire, &inputs[rank], &mut out, reduce)
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
    // amax over the quantization block (of size gs, aligned at the shard start) containing element i.
    let block_amax = |x: &Vec<f32>, i: usize, gs: usize| {
        let (part, k) = (i / s.max(1), i % s.max(1));
        let lo = part * s + (k / gs) * gs;
        let hi = (lo + gs).min(part * s + s);
        (lo..hi).map(|j| get(x, j)).fold(0.0f64, f64::max)
    };
    let scale = if opts.reduce == Reduce::Mean { 1.0 / w as f64 } else { 1.0 };
    let shard_amax: Vec<f64> =
        inputs.iter().map(|x| (shard * s..(shard + 1) * s).map(|j| get(x, j)).fold(0.0, f64::max)).collect();
    (shard * s..(shard + 1) * s)
        .map(|i| {
            if w == 1 {
                return 0.0;
            }
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
                    e += block_amax(x, i, spec.group_size()) * e1;
                    partial_amax += shard_amax[r] * (1.0 + e1);
                }
                if nodes > 1 && local > 1 && m != mt {
                    e += partial_amax * step(&opts.inter_spec);
                }
            }
            ((e + 1e-5 * total_amax + 1e-30) * scale) as f32
        })
        .collect()
}

/// qgZ over the world (sum and mean): within [`qgz_error_bound`] of the exact f64
/// result; the ring-quantized baseline within a loose bound.
pub fn check_qgz<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    let topo = *comm.topology();
    let w = topo.world();
    let rank = comm.rank();
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
    ]
    .iter()
    .enumerate()
    {
        let bound = qgz_error_bound(&topo, &inputs, opts, rank);
        let mut out = vec![f32::NAN; s];
        qgz_reduce_scatter(comm, &inputs[rank], &mut out, opts).map_err(|e| err("qgz_reduce_scatter", e))?;
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

/// Every primitive with every kind of bad argument: a group with a rank outside the
/// world, a group without the caller, buffers of the wrong lengths, counts of the
/// wrong number or that do not add up, and a broadcast root outside the group. Each
/// call must fail with exactly the error the [`Communicator`] checks document
/// (variant and words, the same on every backend), count no traffic, and leave the
/// communicator usable. Collective: every rank makes the same bad calls (so on a
/// backend whose members agree on errors, every member rejects its own
/// arguments). Returns the number of checks that passed.
pub fn check_argument_errors<C: Communicator + ?Sized>(comm: &mut C) -> Result<usize, String> {
    let topo = *comm.topology();
    let (w, me) = (topo.world(), comm.rank());
    let world = Group::world(&topo);
    let before = comm.traffic().snapshot();
    let mut checks = 0usize;
    let mut expect = |what: &str, got: Result<(), CommError>, want: CommError| -> Result<(), String> {
        match got {
            Err(e) if e == want => {
                checks += 1;
                Ok(())
            }
            Err(e) => Err(format!("{what}: rank {me} got the error {e:?}, expected {want:?}")),
            Ok(()) => Err(format!("{what}: rank {me} got Ok, expected {want:?}")),
        }
    };
    let mismatch = |m: String| CommError::Mismatch(m);
    let invalid = |m: String| CommError::InvalidGroup(m);

    // 1. Bad groups, for every primitive (arguments otherwise valid for the group):
    //    a member outside the world (a fixed message), a group without the caller.
    let bigger = Topology::ranks(w + 1).per_node(1).map_err(|e| e.to_string())?;
    let outside = Group::new(&bigger, vec![me, w]).map_err(|e| e.to_string())?;
    let mut bad_groups = vec![(outside, Some(format!("rank {w} is outside a world of {w}")))];
    if w > 1 {
        bad_groups.push((Group::new(&topo, vec![(me + 1) % w]).map_err(|e| e.to_string())?, None));
    }
    for (group, fixed) in &bad_groups {
        let want = |p: Primitive| {
            invalid(fixed.clone().unwrap_or_else(|| {
                format!("rank {me} called {p} on group {:?} without being a member", group.ranks())
            }))
        };
        let n = group.size();
        let mut recv = vec![0u8; n];
        let r = comm.all_gather_bytes(group, &[1], &mut recv);
        expect("all_gather, bad group", r, want(Primitive::AllGather))?;
        let r = comm.all_to_all_bytes(group, &vec![1; n], &mut recv);
        expect("all_to_all, bad group", r, want(Primitive::AllToAll))?;
        let ones = vec![1usize; n];
        let r = comm.all_to_all_v_bytes(group, &vec![1; n], &ones, &mut recv, &ones);
        expect("all_to_all_v, bad group", r, want(Primitive::AllToAllV))?;
        let r = comm.reduce_scatter_f32(group, &vec![1.0; n], &mut [0.0]);
        expect("reduce_scatter, bad group", r, want(Primitive::ReduceScatter))?;
        let r = comm.all_reduce_f32(group, &mut [1.0]);
        expect("all_reduce, bad group", r, want(Primitive::AllReduce))?;
        let r = comm.broadcast_bytes(group, 0, &mut [0u8; 2]);
        expect("broadcast, bad group", r, want(Primitive::Broadcast))?;
        let r = comm.barrier(group);
        expect("barrier, bad group", r, want(Primitive::Barrier))?;
    }

    // 2. Bad arguments on the world group.
    let mut recv = vec![0u8; 3 * w + 1];
    let r = comm.all_gather_bytes(&world, &[7; 3], &mut recv);
    expect(
        "all_gather, receive buffer one byte too long",
        r,
        mismatch(format!("all_gather: receive buffer of {} bytes for {w} chunks of 3 bytes", 3 * w + 1)),
    )?;
    let r = comm.all_gather_bytes(&world, &[7; 3], &mut []);
    expect(
        "all_gather, empty receive buffer",
        r,
        mismatch(format!("all_gather: receive buffer of 0 bytes for {w} chunks of 3 bytes")),
    )?;
    let r = comm.all_to_all_bytes(&world, &vec![7; 2 * w], &mut recv[..2 * w + 1]);
    expect(
        "all_to_all, send and receive lengths differ",
        r,
        mismatch(format!(
            "all_to_all: send {} and receive {} bytes must be equal multiples of the group size {w}",
            2 * w,
            2 * w + 1
        )),
    )?;
    if w > 1 {
        let r = comm.all_to_all_bytes(&world, &vec![7; 2 * w + 1], &mut recv[..2 * w + 1]);
        expect(
            "all_to_all, lengths not a multiple of the group size",
            r,
            mismatch(format!(
                "all_to_all: send {0} and receive {0} bytes must be equal multiples of the group size {w}",
                2 * w + 1
            )),
        )?;
    }
    let ones = vec![1usize; w];
    let one_more = vec![1usize; w + 1];
    let mut recv = vec![0u8; w + 1];
    let r = comm.all_to_all_v_bytes(&world, &vec![7; w + 1], &one_more, &mut recv[..w], &ones);
    expect(
        "all_to_all_v, one send count too many",
        r,
        mismatch(format!("all_to_all_v: {} send and {w} receive counts for a group of {w}", w + 1)),
    )?;
    let r = comm.all_to_all_v_bytes(&world, &vec![7; w], &ones, &mut recv, &one_more[..w - 1]);
    expect(
        "all_to_all_v, one receive count too few",
        r,
        mismatch(format!("all_to_all_v: {w} send and {} receive counts for a group of {w}", w - 1)),
    )?;
    let r = comm.all_to_all_v_bytes(&world, &vec![7; w + 1], &ones, &mut recv[..w], &ones);
    expect(
        "all_to_all_v, send counts do not add up",
        r,
        mismatch(format!(
            "all_to_all_v: counts do not add up to the buffer lengths (send counts {w} for {} bytes, receive counts {w} for {w} bytes)",
            w + 1
        )),
    )?;
    let r = comm.all_to_all_v_bytes(&world, &vec![7; w], &ones, &mut recv, &ones);
    expect(
        "all_to_all_v, receive counts do not add up",
        r,
        mismatch(format!(
            "all_to_all_v: counts do not add up to the buffer lengths (send counts {w} for {w} bytes, receive counts {w} for {} bytes)",
            w + 1
        )),
    )?;
    // Counts whose sum overflows (reported saturated, never wrapped or panicking).
    let mut huge = vec![0usize; w];
    huge[me] = usize::MAX;
    if w > 1 {
        huge[(me + 1) % w] = 2;
    }
    let r = comm.all_to_all_v_bytes(&world, &[7; 1], &huge, &mut recv[..1], &huge);
    expect(
        "all_to_all_v, counts that overflow",
        r,
        mismatch(format!(
            "all_to_all_v: counts do not add up to the buffer lengths (send counts {0} for 1 bytes, receive counts {0} for 1 bytes)",
            usize::MAX
        )),
    )?;
    if w > 1 {
        // Both sums right (w + 1), but 2 bytes to itself against 1 expected from itself.
        let mut own = vec![1usize; w];
        own[me] = 2;
        let mut more = vec![1usize; w];
        more[(me + 1) % w] = 2;
        let r = comm.all_to_all_v_bytes(&world, &vec![7; w + 1], &own, &mut recv, &more);
        expect(
            "all_to_all_v, own chunk differs",
            r,
            mismatch("all_to_all_v: this rank sends itself 2 bytes but expects 1".into()),
        )?;
    }
    let mut out = [0.0f32; 2];
    let r = comm.reduce_scatter_f32(&world, &vec![1.0; 2 * w + 1], &mut out);
    expect(
        "reduce_scatter, send one element too long",
        r,
        mismatch(format!("reduce_scatter: send of {} elements for {w} chunks of 2", 2 * w + 1)),
    )?;
    let r = comm.reduce_scatter_f32(&world, &vec![1.0; 2 * w], &mut out[..1]);
    expect(
        "reduce_scatter, receive one element too short",
        r,
        mismatch(format!("reduce_scatter: send of {} elements for {w} chunks of 1", 2 * w)),
    )?;
    for root in [w, w + 5] {
        let r = comm.broadcast_bytes(&world, root, &mut [0u8; 4]);
        expect(
            "broadcast, root outside the group",
            r,
            invalid(format!("broadcast root index {root} in a group of {w}")),
        )?;
    }

    // 3. No traffic was counted, and the communicator still works.
    ensure(comm.traffic().snapshot() == before, || {
        format!("rank {me}: rejected calls changed the traffic counters")
    })?;
    let mut all = vec![0u32; w];
    comm.all_gather(&world, &[me as u32], &mut all)
        .map_err(|e| err("all_gather after the rejected calls", e))?;
    ensure(all.iter().enumerate().all(|(r, &v)| v == r as u32), || {
        "all_gather after the rejected calls: wrong result".into()
    })?;
    Ok(checks + 1)
}

/// Runs every check of the suite, in a fixed order.
pub fn run_all<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    check_all_gather(comm, case)?;
    check_all_to_all(comm, case)?;
    check_all_to_all_v(comm, case)?;
    check_reductions(comm, case)?;
    check_broadcast_barrier(comm, case)?;
    check_baselines(comm, case)?;
    check_qwz(comm, case)?;
    check_qgz(comm, case)?;
    check_world_collectives(comm, case)?;
    check_duplicate_async(comm, case)
}
