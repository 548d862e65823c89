//! Deterministic checks of layouts, plans, qgZ order and the memory report.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use zeropp_comm::Topology;
use zeropp_partition::{
    DType, MemoryReport, ParamRegistry, ParamSpec, PartitionError, PartitionPlan, PlanConfig,
};

fn registry() -> ParamRegistry {
    let mut reg = ParamRegistry::new();
    reg.push_bucket("embed", vec![ParamSpec::new("embed.w", [10, 7], DType::BF16)]).unwrap();
    reg.push_bucket(
        "layer0",
        vec![
            ParamSpec::new("layer0.w", [7, 7], DType::BF16),
            ParamSpec::new("layer0.b", [7], DType::F32),
            ParamSpec::new("layer0.scale", Vec::<usize>::new(), DType::F16),
        ],
    )
    .unwrap();
    reg
}

fn plan(world: usize, local: usize, align: usize, hpz: usize) -> PartitionPlan {
    PartitionPlan::new(
        &registry(),
        Topology::ranks(world).per_node(local).unwrap(),
        PlanConfig::new(align, hpz),
    )
    .unwrap()
}

#[test]
fn layout_offsets_and_padding() {
    let p = plan(8, 4, 4, 1);
    let b = p.bucket(1).unwrap();
    assert_eq!(b.numel, 49 + 7 + 1);
    assert_eq!(b.padded_len, 64); // multiple of 8 × 4
    assert_eq!(b.padding(), 7);
    let offsets: Vec<_> = b.params.iter().map(|s| (s.offset, s.numel)).collect();
    assert_eq!(offsets, vec![(0, 49), (49, 7), (56, 1)]);
    assert_eq!(p.bucket(0).unwrap().padded_len, 96);
    assert_eq!(p.numel(), 70 + 57);
    assert_eq!(p.padded_numel(), 96 + 64);
}

#[test]
fn flatten_unflatten_round_trip() {
    let p = plan(4, 2, 2, 1);
    let b = p.bucket(1).unwrap();
    let w: Vec<f32> = (0..49).map(|i| i as f32).collect();
    let bias: Vec<f32> = (0..7).map(|i| -(i as f32)).collect();
    let scale = [3.5f32];
    let flat = b.flatten(&[&w, &bias, &scale]).unwrap();
    assert_eq!(flat.len(), b.padded_len);
    assert!(flat[b.numel..].iter().all(|&x| x == 0.0));
    let parts = b.unflatten(&flat).unwrap();
    assert_eq!(parts, vec![&w[..], &bias[..], &scale[..]]);
    assert!(matches!(
        b.flatten(&[&w[..], &bias[..3], &scale[..]]),
        Err(PartitionError::LengthMismatch { .. })
    ));
    assert!(b.flatten::<f32>(&[&w]).is_err());
    assert!(b.unflatten(&flat[..10]).is_err());
}

#[test]
fn registry_rejects_duplicates_and_empty_names() {
    let mut reg = registry();
    let dup = reg.push_bucket("x", vec![ParamSpec::new("layer0.w", [1], DType::F32)]);
    assert!(matches!(dup, Err(PartitionError::InvalidRegistry(_))));
    assert!(reg.push_bucket("layer0", vec![]).is_err());
    assert!(reg.push_bucket("", vec![]).is_err());
    assert!(reg.push_bucket("y", vec![ParamSpec::new("", [1], DType::F32)]).is_err());
    assert!(reg.push_bucket("z", vec![ParamSpec::new("big", [usize::MAX, 2], DType::F32)]).is_err());
    assert_eq!(reg.buckets().len(), 2);
}

#[test]
fn invalid_configs_are_clear_errors() {
    let t = Topology::ranks(8).per_node(4).unwrap();
    let reg = registry();
    let err = PartitionPlan::new(&reg, t, PlanConfig::new(4, 3)).unwrap_err();
    assert!(matches!(err, PartitionError::InvalidHpz { hpz: 3, local_size: 4 }));
    assert!(err.to_string().contains("divide local_size 4"), "{err}");
    assert!(PartitionPlan::new(&reg, t, PlanConfig::new(4, 0)).is_err());
    assert!(PartitionPlan::new(&reg, t, PlanConfig::new(4, 8)).is_err());
    assert!(matches!(
        PartitionPlan::new(&reg, t, PlanConfig::new(0, 1)),
        Err(PartitionError::InvalidConfig(_))
    ));
    assert!(PartitionPlan::new(&reg, t, PlanConfig::new(usize::MAX, 1)).is_err());
    let p = plan(8, 4, 4, 2);
    assert!(matches!(p.primary_range(8, 0), Err(PartitionError::RankOutOfRange { rank: 8, world: 8 })));
    assert!(matches!(p.primary_range(0, 2), Err(PartitionError::BucketOutOfRange { bucket: 2, buckets: 2 })));
    assert!(p.qgz_peer_shards(4).is_err());
    assert!(p.memory_report(9).is_err());
}

#[test]
fn primary_grad_optimizer_ranges_agree() {
    let p = plan(8, 4, 4, 4);
    for r in 0..8 {
        for b in 0..2 {
            let prim = p.primary_range(r, b).unwrap();
            assert_eq!(prim.len() % 4, 0);
            assert_eq!(p.grad_range(r, b).unwrap(), prim);
            assert_eq!(p.optimizer_range(r, b).unwrap(), prim);
        }
    }
    assert_eq!(p.primary_range(3, 1).unwrap(), 24..32);
}

#[test]
fn hpz_groups_and_secondary_ranges() {
    // 2 nodes × 4, hpZ groups of 2.
    let p = plan(8, 4, 2, 2);
    assert!(p.hpz_enabled());
    let g = p.hpz_group(5).unwrap();
    assert_eq!((g.ranks.clone(), g.index), (vec![4, 5], 1));
    assert_eq!(p.hpz_group(6).unwrap().ranks, vec![6, 7]);
    assert_eq!(p.hpz_group(2).unwrap().ranks, vec![2, 3]);
    let len = p.bucket(0).unwrap().padded_len;
    assert_eq!(p.secondary_range(5, 0).unwrap(), Some(len / 2..len));
    assert_eq!(p.secondary_range(4, 0).unwrap(), Some(0..len / 2));

    // hpZ off.
    let off = plan(8, 4, 2, 1);
    assert!(!off.hpz_enabled());
    assert_eq!(off.secondary_range(5, 0).unwrap(), None);
    let g = off.hpz_group(5).unwrap();
    assert_eq!((g.ranks, g.index), (vec![5], 0));
    assert_eq!(off.rank_plan(5).unwrap().secondary, None);
}

#[test]
fn qgz_order_two_nodes_of_four() {
    let p = plan(8, 4, 1, 1);
    assert_eq!(p.qgz_peer_shards(0).unwrap(), vec![0, 4]);
    assert_eq!(p.qgz_peer_shards(3).unwrap(), vec![3, 7]);
    assert_eq!(p.qgz_slice_order(), vec![0, 4, 1, 5, 2, 6, 3, 7]);
    let len = p.shard_len(0).unwrap();
    let ranges = p.qgz_reordered_ranges(0).unwrap();
    assert_eq!(ranges[1], 4 * len..5 * len);
    let rp = p.rank_plan(6).unwrap();
    assert_eq!((rp.node, rp.local_rank), (1, 2));
    assert_eq!(rp.qgz_send_order[2], vec![2, 6]);
    assert_eq!(rp.primary.len(), 2);
}

#[test]
fn memory_report_matches_formula() {
    for (world, local, align, hpz) in
        [(1, 1, 1, 1), (8, 4, 4, 1), (8, 4, 4, 2), (8, 4, 4, 4), (16, 8, 16, 8), (6, 3, 2, 3)]
    {
        let p = plan(world, local, align, hpz);
        let psi = p.padded_numel();
        for r in 0..world {
            let m = p.memory_report(r).unwrap();
            assert_eq!(m.padded_params, psi);
            assert_eq!(m.params, p.numel());
            assert_eq!(m.master_bytes, 4 * psi / world);
            assert_eq!(m.working_bytes, 2 * psi / world);
            assert_eq!(m.gradient_bytes, 2 * psi / world);
            assert_eq!(m.optimizer_bytes, 8 * psi / world);
            let sec = if hpz > 1 { 2 * psi / hpz } else { 0 };
            assert_eq!(m.secondary_bytes, sec);
            assert_eq!(m.total_bytes(), (2 + 2 + 12) * psi / world + sec);
            assert_eq!(m.total_bytes(), MemoryReport::formula(psi, world, hpz));
        }
    }
}

#[test]
fn partition_accepts_numel_or_padded_inputs() {
    let p = plan(4, 2, 4, 2);
    let b = p.bucket(0).unwrap();
    let real: Vec<f32> = (1..=b.numel).map(|i| i as f32).collect();
    let shards = p.partition(0, &real).unwrap();
    let full = p.gather(0, &shards).unwrap();
    assert_eq!(&full[..b.numel], &real[..]);
    assert!(full[b.numel..].iter().all(|&x| x == 0.0));
    assert!(p.partition(0, &real[..5]).is_err());
    assert!(p.gather(0, &shards[..3]).is_err());
    let mut bad = shards.clone();
    bad[2].pop();
    assert!(p.gather(0, &bad).is_err());
}
