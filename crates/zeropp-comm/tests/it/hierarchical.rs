//! The world collectives with hierarchical routing against the flat ones and
//! against an f64 reference, over topologies with one node, one rank per node and
//! several of each, and lengths 0, 1, primes and 20011.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap

use proptest::prelude::*;
use zeropp_comm::collectives::{
    DenseWire, QwzOptions, Reduce, Routing, dequantize_encodings, qwz_all_gather, shard_len,
    world_all_gather, world_all_gather_bytes, world_qwz_all_gather, world_qwz_gather_encoded,
    world_reduce_scatter, world_reduce_scatter_bytes,
};
use zeropp_comm::conformance::rank_data;
use zeropp_comm::{CommError, CommExt, Communicator, Group, ThreadCluster, ThreadOptions, Topology};
use zeropp_quant::{Options, QuantSpec, encoded_len, quantize_to_wire};

/// (nodes, ranks per node): one rank, one node, one rank per node, 2x4, 4x2, 3x3, 3x2.
const SHAPES: [(usize, usize); 8] = [(1, 1), (1, 4), (4, 1), (2, 4), (4, 2), (3, 3), (3, 2), (2, 1)];
const LENGTHS: [usize; 8] = [0, 1, 2, 7, 13, 31, 97, 20_011];

fn cluster(nodes: usize, local: usize) -> (Topology, ThreadCluster) {
    let t = Topology::ranks(nodes * local).per_node(local).unwrap();
    (t, ThreadCluster::new(t, ThreadOptions::default().with_timeout(std::time::Duration::from_secs(60))))
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Every gather (dense on both wires, qwZ with two specs) routed hierarchically
/// equals the flat one bit for bit, on every rank.
fn gathers_equal(nodes: usize, local: usize, len: usize, seed: u64) -> Result<(), String> {
    let (t, cl) = cluster(nodes, local);
    let w = t.world();
    let qwz = [QwzOptions::default(), QwzOptions::with_spec(QuantSpec::int4(7).unwrap())];
    cl.run(|comm| -> Result<(), CommError> {
        let shard = rank_data(seed, comm.rank(), len);
        let world = Group::world(&t);
        for wire in DenseWire::ALL {
            let mut flat = vec![f32::NAN; len * w];
            world_all_gather(comm, Routing::Flat, wire, &shard, &mut flat)?;
            let mut hier = vec![f32::NAN; len * w];
            world_all_gather(comm, Routing::Hierarchical, wire, &shard, &mut hier)?;
            if bits(&flat) != bits(&hier) {
                return Err(CommError::Mismatch(format!("dense {wire} gather: hierarchical != flat")));
            }
            // And the flat one is the wire-rounded inputs in world order.
            let expect: Vec<f32> = (0..w)
                .flat_map(|r| rank_data(seed, r, len))
                .map(|x| if wire == DenseWire::Bf16 { half::bf16::from_f32(x).to_f32() } else { x })
                .collect();
            if bits(&flat) != bits(&expect) {
                return Err(CommError::Mismatch(format!("dense {wire} gather: wrong values")));
            }
        }
        for o in &qwz {
            let mut base = vec![f32::NAN; len * w];
            qwz_all_gather(comm, &world, &shard, &mut base, o)?;
            for routing in Routing::ALL {
                let mut got = vec![f32::NAN; len * w];
                world_qwz_all_gather(comm, routing, &shard, &mut got, o)?;
                if bits(&got) != bits(&base) {
                    return Err(CommError::Mismatch(format!("qwz {routing}: differs from qwz_all_gather")));
                }
            }
            let a = world_qwz_gather_encoded(comm, Routing::Flat, &shard, o)?;
            let b = world_qwz_gather_encoded(comm, Routing::Hierarchical, &shard, o)?;
            if a != b || a.len() != w * encoded_len(o.spec, len) {
                return Err(CommError::Mismatch("qwz encodings: hierarchical != flat".into()));
            }
        }
        Ok(())
    })
    .map(|_| ())
    .map_err(|e| format!("{nodes}x{local} len {len}: {e}"))
}

#[test]
fn hierarchical_gathers_equal_flat_bitwise() {
    for (nodes, local) in SHAPES {
        for len in LENGTHS {
            gathers_equal(nodes, local, len, 17).unwrap();
        }
    }
}

/// Every routing, wire and reduction on one shape and length: each rank's shard
/// within the bf16 rounding bound of the f64 sum (padding exactly 0), and the
/// hierarchical f32 result within 1e-6 of the flat one (relative to `Σ|x|`).
fn reduce_scatter_case(nodes: usize, local: usize, n: usize, seed: u64) {
    let (t, cl) = cluster(nodes, local);
    let w = t.world();
    let s = shard_len(n, w);
    let inputs: Vec<Vec<f32>> = (0..w).map(|r| rank_data(seed, r, n)).collect();
    let combos: Vec<(Routing, DenseWire, Reduce)> = Routing::ALL
        .into_iter()
        .flat_map(|r| DenseWire::ALL.into_iter().map(move |d| (r, d)))
        .flat_map(|(r, d)| [Reduce::Sum, Reduce::Mean].map(|x| (r, d, x)))
        .collect();
    let outs = cl
        .run(|comm| -> Result<Vec<Vec<f32>>, CommError> {
            let mut v = Vec::new();
            for &(routing, wire, reduce) in &combos {
                let mut out = vec![f32::NAN; s];
                world_reduce_scatter(comm, routing, wire, &inputs[comm.rank()], &mut out, reduce)?;
                v.push(out);
            }
            Ok(v)
        })
        .unwrap();
    let u = 2f64.powi(-8); // bf16 unit roundoff
    for (rank, per) in outs.iter().enumerate() {
        for (ci, &(routing, wire, reduce)) in combos.iter().enumerate() {
            let out = &per[ci];
            assert_eq!(out.len(), s);
            // Rounding hops on the wire: bf16 rounds once per hop that exists.
            let hops = match (wire, routing) {
                (DenseWire::F32, _) => 0,
                // The flat baseline rounds every contribution, its own included.
                (DenseWire::Bf16, Routing::Flat) => 1,
                (DenseWire::Bf16, Routing::Hierarchical) => usize::from(local > 1) + usize::from(nodes > 1),
            };
            let scale = if reduce == Reduce::Mean { 1.0 / w as f64 } else { 1.0 };
            for (k, &y) in out.iter().enumerate() {
                let i = rank * s + k;
                if i >= n {
                    assert_eq!(y.to_bits(), 0, "{nodes}x{local} {routing} {wire}: padding {i} not zero");
                    continue;
                }
                let exact: f64 = inputs.iter().map(|x| f64::from(x[i])).sum::<f64>() * scale;
                let mag: f64 = inputs.iter().map(|x| f64::from(x[i]).abs()).sum::<f64>() * scale;
                let tol = (hops as f64 * u * (1.0 + 2.0 * u) + (w + 2) as f64 * 2f64.powi(-24)) * mag + 1e-30;
                let err = (f64::from(y) - exact).abs();
                assert!(
                    err <= tol,
                    "{nodes}x{local} n {n} {routing} {wire} {reduce:?} element {i}: got {y}, exact {exact}, err {err} > {tol}"
                );
            }
        }
        // F32 wire: hierarchical within 1e-6 (relative to the magnitude sum) of flat.
        for reduce in [Reduce::Sum, Reduce::Mean] {
            let idx = |routing| combos.iter().position(|c| *c == (routing, DenseWire::F32, reduce)).unwrap();
            let (flat, hier) = (&per[idx(Routing::Flat)], &per[idx(Routing::Hierarchical)]);
            let scale = if reduce == Reduce::Mean { 1.0 / w as f64 } else { 1.0 };
            for (k, (&a, &b)) in flat.iter().zip(hier).enumerate() {
                let i = rank * s + k;
                let mag: f64 =
                    inputs.iter().map(|x| f64::from(x.get(i).copied().unwrap_or(0.0)).abs()).sum::<f64>()
                        * scale;
                let d = (f64::from(a) - f64::from(b)).abs();
                assert!(d <= 1e-6 * mag, "{nodes}x{local} n {n} {reduce:?} element {i}: flat {a} hier {b}");
            }
        }
    }
}

#[test]
fn hierarchical_reduce_scatter_against_f64_and_flat() {
    for (nodes, local) in SHAPES {
        for n in LENGTHS {
            reduce_scatter_case(nodes, local, n, 23);
        }
    }
}

#[test]
fn routing_and_wire_parse() {
    for r in Routing::ALL {
        assert_eq!(r.name().parse::<Routing>().unwrap(), r);
        assert_eq!(r.to_string(), r.name());
    }
    for d in DenseWire::ALL {
        assert_eq!(d.name().parse::<DenseWire>().unwrap(), d);
        assert_eq!(d.to_string(), d.name());
    }
    assert_eq!(Routing::default(), Routing::Hierarchical);
    assert_eq!(DenseWire::default(), DenseWire::Bf16);
    assert_eq!((DenseWire::Bf16.bytes(), DenseWire::F32.bytes()), (2, 4));
    let e = "tree".parse::<Routing>().unwrap_err();
    assert!(matches!(&e, CommError::InvalidConfig(m) if m.contains("tree") && m.contains("hierarchical")));
    let e = "fp16".parse::<DenseWire>().unwrap_err();
    assert!(matches!(&e, CommError::InvalidConfig(m) if m.contains("fp16") && m.contains("bf16")));
}

#[test]
fn wrong_buffer_sizes_are_mismatches() {
    let (t, cl) = cluster(2, 2);
    let errs = cl
        .run(|comm| -> Result<Vec<CommError>, CommError> {
            let mut v = Vec::new();
            for routing in Routing::ALL {
                for wire in DenseWire::ALL {
                    v.push(world_all_gather(comm, routing, wire, &[1.0; 3], &mut [0.0; 11]).unwrap_err());
                    v.push(
                        world_reduce_scatter(comm, routing, wire, &[1.0; 10], &mut [0.0; 2], Reduce::Sum)
                            .unwrap_err(),
                    );
                }
                let o = QwzOptions::default();
                v.push(world_qwz_all_gather(comm, routing, &[1.0; 3], &mut [0.0; 13], &o).unwrap_err());
            }
            Ok(v)
        })
        .unwrap();
    assert_eq!(t.world(), errs.len());
    for e in errs.iter().flatten() {
        assert!(matches!(e, CommError::Mismatch(_)), "{e}");
    }
}

#[test]
fn dequantize_encodings_validates() {
    let spec = QuantSpec::int8(4).unwrap();
    let opts = Options::default();
    let e = encoded_len(spec, 5);
    let mut bytes = vec![0u8; 3 * e];
    for (j, chunk) in bytes.chunks_exact_mut(e).enumerate() {
        quantize_to_wire(&[j as f32; 5], spec, &opts, chunk).unwrap();
    }
    let mut full = [f32::NAN; 15];
    dequantize_encodings(&bytes, 5, &mut full, &opts).unwrap();
    let expect: Vec<f32> = (0..3)
        .flat_map(|j| {
            zeropp_quant::dequantize(&zeropp_quant::quantize(&[j as f32; 5], spec, &opts).unwrap(), &opts)
                .unwrap()
        })
        .collect();
    assert_eq!(bits(&full), bits(&expect));
    assert!(full.iter().enumerate().all(|(i, &x)| (x - (i / 5) as f32).abs() <= 2.0 / 128.0));
    let mismatch = |r: Result<(), CommError>| matches!(r, Err(CommError::Mismatch(_)));
    // Wrong element count per encoding, too many and too few encodings.
    assert!(mismatch(dequantize_encodings(&bytes, 4, &mut [0.0; 12], &opts)));
    assert!(mismatch(dequantize_encodings(&bytes, 5, &mut [0.0; 10], &opts)));
    assert!(mismatch(dequantize_encodings(&bytes, 5, &mut [0.0; 20], &opts)));
    // Truncated and corrupted encodings.
    let r = dequantize_encodings(&bytes[..3 * e - 1], 5, &mut full, &opts);
    assert!(matches!(r, Err(CommError::Quant(_))), "{r:?}");
    let mut bad = bytes.clone();
    bad[e + 20] ^= 1; // payload_len of the second header (checksummed)
    let r = dequantize_encodings(&bad, 5, &mut full, &opts);
    assert!(matches!(r, Err(CommError::Quant(_))), "{r:?}");
    // Encodings of zero elements: any count fills an empty output.
    let e0 = encoded_len(spec, 0);
    let mut zero = vec![0u8; 2 * e0];
    for chunk in zero.chunks_exact_mut(e0) {
        quantize_to_wire::<f32>(&[], spec, &opts, chunk).unwrap();
    }
    dequantize_encodings(&zero, 0, &mut [], &opts).unwrap();
    dequantize_encodings(&[], 0, &mut [], &opts).unwrap();
    assert!(mismatch(dequantize_encodings(&zero, 1, &mut [0.0; 2], &opts)));
}

/// (nodes, ranks per node) with a world of at most 12.
fn shape() -> impl Strategy<Value = (usize, usize)> {
    (1usize..=12).prop_flat_map(|w| {
        let divisors: Vec<usize> = (1..=w).filter(|d| w % d == 0).collect();
        proptest::sample::select(divisors).prop_map(move |l| (w / l, l))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    /// Routing invariants on random shapes and lengths: gathers are bit-identical
    /// across routings; the f32 reduce-scatters agree to 1e-6 of the magnitude sum;
    /// every rank's counters equal the formulas, and hierarchical routing never sends
    /// more inter-node bytes than flat (strictly fewer when there are several nodes
    /// with several ranks each and data to send).
    #[test]
    fn routing_invariants((nodes, local) in shape(), len in prop_oneof![Just(0usize), Just(1), Just(5), 0usize..400], seed in any::<u64>()) {
        prop_assert_eq!(gathers_equal(nodes, local, len, seed), Ok(()));
        let (t, cl) = cluster(nodes, local);
        let w = t.world();
        let s = shard_len(len, w);
        let outs = cl.run(|comm| -> Result<_, CommError> {
            let full = rank_data(seed, comm.rank(), len);
            let mut res = Vec::new();
            for routing in Routing::ALL {
                comm.set_op(routing.name());
                let mut out = vec![0.0; s];
                world_reduce_scatter(comm, routing, DenseWire::Bf16, &full, &mut out, Reduce::Mean)?;
                comm.set_op(&format!("{routing}-gather"));
                world_all_gather(comm, routing, DenseWire::F32, &full, &mut vec![0.0; len * w])?;
                let mut out = vec![0.0; s];
                comm.set_op("f32");
                world_reduce_scatter(comm, routing, DenseWire::F32, &full, &mut out, Reduce::Sum)?;
                res.push(out);
            }
            Ok((res, comm.traffic().snapshot()))
        }).unwrap();
        let inputs: Vec<Vec<f32>> = (0..w).map(|r| rank_data(seed, r, len)).collect();
        for (rank, (res, snap)) in outs.iter().enumerate() {
            for (k, (&a, &b)) in res[0].iter().zip(&res[1]).enumerate() {
                let i = rank * s + k;
                let mag: f64 = inputs.iter().map(|x| f64::from(x.get(i).copied().unwrap_or(0.0)).abs()).sum();
                prop_assert!((f64::from(a) - f64::from(b)).abs() <= 1e-6 * mag, "element {}: {} vs {}", i, a, b);
            }
            for routing in Routing::ALL {
                let rs = snap.op(routing.name());
                let f = world_reduce_scatter_bytes(&t, routing, DenseWire::Bf16, len);
                prop_assert_eq!((rs.intra.bytes_sent, rs.inter.bytes_sent), (f.intra, f.inter));
                let ag = snap.op(&format!("{routing}-gather"));
                let f = world_all_gather_bytes(&t, routing, DenseWire::F32, len);
                prop_assert_eq!((ag.intra.bytes_sent, ag.inter.bytes_sent), (f.intra, f.inter));
            }
            let (flat, hier) = (snap.op("flat").inter.bytes_sent, snap.op("hierarchical").inter.bytes_sent);
            prop_assert!(hier <= flat);
            if nodes > 1 && local > 1 && s > 0 {
                prop_assert!(hier < flat);
            }
        }
    }
}
