//! The layers agree with each other: the shard maps of `zeropp-partition` are
//! exactly what the collectives of `zeropp-comm` produce and consume, on the thread
//! backend, for random registries and topologies.
//!
//! Each crate tests itself against its own references; this file checks the seams:
//! a primary shard gathered over the world is the padded bucket, an hpZ group's
//! secondary shards gathered inside the node are the same bucket, and the gradient
//! shard a rank receives from the (baseline or qgZ) reduce-scatter is the plan's
//! gradient range of the mean gradient.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use proptest::prelude::*;
use zeropp_comm::collectives::{QgzOptions, Reduce, all_gather_f32, qgz_reduce_scatter, reduce_scatter};
use zeropp_comm::{CommError, Group, ThreadCluster, ThreadOptions, Topology};
use zeropp_partition::{DType, ParamRegistry, ParamSpec, PartitionPlan, PlanConfig};

/// Deterministic "parameter" value of element `i` of bucket `b` (same on every rank).
fn weight(b: usize, i: usize) -> f32 {
    ((i * 37 + b * 11) % 101) as f32 / 101.0 - 0.5
}

/// Deterministic "gradient" of `rank` for element `i` of bucket `b`.
fn grad(rank: usize, b: usize, i: usize) -> f32 {
    (((i * 13 + rank * 29 + b * 7) % 97) as f32 / 97.0 - 0.5) * (1.0 + rank as f32 / 8.0)
}

fn registry(shapes: &[Vec<Vec<usize>>]) -> ParamRegistry {
    let mut reg = ParamRegistry::new();
    for (b, params) in shapes.iter().enumerate() {
        let specs = params
            .iter()
            .enumerate()
            .map(|(p, shape)| ParamSpec::new(format!("b{b}.p{p}"), shape.clone(), DType::F32))
            .collect();
        reg.push_bucket(format!("bucket{b}"), specs).unwrap();
    }
    reg
}

/// (world, local_size, hpz) with hpz dividing local_size.
fn topology() -> impl Strategy<Value = (usize, usize, usize)> {
    (1usize..=3, 1usize..=4).prop_flat_map(|(nodes, local)| {
        let divisors: Vec<usize> = (1..=local).filter(|d| local % d == 0).collect();
        (Just(nodes * local), Just(local), proptest::sample::select(divisors))
    })
}

fn shapes() -> impl Strategy<Value = Vec<Vec<Vec<usize>>>> {
    let shape = prop_oneof![
        (1usize..40).prop_map(|n| vec![n]),
        (1usize..9, 1usize..9).prop_map(|(a, b)| vec![a, b]),
    ];
    prop::collection::vec(prop::collection::vec(shape, 1..4), 1..4)
}

fn check(world: usize, local: usize, hpz: usize, align: usize, shapes: &[Vec<Vec<usize>>]) {
    let topo = Topology::ranks(world).per_node(local).unwrap();
    let plan = PartitionPlan::new(&registry(shapes), topo, PlanConfig::new(align, hpz)).unwrap();
    let cluster = ThreadCluster::new(topo, ThreadOptions::default());
    let plan = &plan;
    cluster
        .run(|comm| {
            let rank = comm.rank();
            let world_group = Group::world(comm.topology());
            for (b, layout) in plan.buckets().iter().enumerate() {
                let padded = layout.padded_len;
                let full: Vec<f32> =
                    (0..padded).map(|i| if i < layout.numel { weight(b, i) } else { 0.0 }).collect();

                // Primary shards gathered over the world are the padded bucket.
                let primary = plan.primary_range(rank, b).unwrap();
                let mut gathered = vec![f32::NAN; padded];
                all_gather_f32(comm, &world_group, &full[primary.clone()], &mut gathered)?;
                assert_eq!(gathered, full, "world gather of primaries, bucket {b}");

                // hpZ: the secondary shards of the hpZ group, gathered on the node.
                if let Some(sec) = plan.secondary_range(rank, b).unwrap() {
                    let hg = plan.hpz_group(rank).unwrap();
                    assert!(hg.ranks.iter().all(|&r| topo.same_node(r, rank)), "hpZ group leaves the node");
                    let group = Group::new(comm.topology(), hg.ranks.clone())?;
                    let mut again = vec![f32::NAN; padded];
                    all_gather_f32(comm, &group, &full[sec], &mut again)?;
                    assert_eq!(again, full, "hpZ gather of secondaries, bucket {b}");
                }

                // Gradient reduce-scatter lands on the plan's gradient range.
                let g: Vec<f32> = (0..padded).map(|i| grad(rank, b, i)).collect();
                let range = plan.grad_range(rank, b).unwrap();
                let mean =
                    |i: usize| (0..world).map(|r| f64::from(grad(r, b, i))).sum::<f64>() / world as f64;
                let mut shard = vec![f32::NAN; plan.shard_len(b).unwrap()];
                reduce_scatter(comm, &world_group, &g, &mut shard, Reduce::Mean)?;
                for (k, i) in range.clone().enumerate() {
                    assert!((f64::from(shard[k]) - mean(i)).abs() < 1e-6, "baseline RS at {i}");
                }
                let mut q = vec![f32::NAN; plan.shard_len(b).unwrap()];
                qgz_reduce_scatter(comm, &g, &mut q, &QgzOptions::default())?;
                // Two INT4 hops on values in [-1, 1]: a loose but failing-capable bound.
                for (k, i) in range.enumerate() {
                    assert!((f64::from(q[k]) - mean(i)).abs() < 0.25, "qgZ at {i}: {} vs {}", q[k], mean(i));
                }
            }
            Ok::<_, CommError>(())
        })
        .unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn partition_plan_matches_collectives((world, local, hpz) in topology(), align in 1usize..5, shapes in shapes()) {
        check(world, local, hpz, align, &shapes);
    }
}

#[test]
fn two_nodes_by_four_with_full_hpz() {
    check(8, 4, 4, 8, &[vec![vec![17, 5], vec![5]], vec![vec![64]]]);
}
