//! Properties of one bucket's layout inside a plan: alignment, packing, the
//! conversions between compact, flat and per-tensor forms, and groups that never
//! straddle two parameters.

use proptest::prelude::*;
use zeropp_comm::Topology;
use zeropp_partition::{DType, ParamRegistry, ParamSpec, PartitionPlan, PlanConfig};

fn one_bucket(sizes: &[usize]) -> ParamRegistry {
    let mut reg = ParamRegistry::new();
    let params = sizes.iter().enumerate().map(|(i, &n)| ParamSpec::new(format!("p{i}"), [n], DType::F32));
    reg.push_bucket("b", params.collect()).unwrap();
    reg
}

proptest! {
    /// Aligned parameters start on multiples of `param_align`, never overlap,
    /// and compact/expand/flatten/unflatten and `shard_of` agree with each other.
    #[test]
    fn aligned_layouts_round_trip(
        sizes in proptest::collection::vec(1usize..300, 1..8),
        param_align in prop_oneof![Just(1usize), Just(3), Just(8), Just(256)],
        align in prop_oneof![Just(1usize), Just(2), Just(256)],
        world in 1usize..5,
    ) {
        let t = Topology::ranks(world).per_node(1).unwrap();
        let cfg = PlanConfig::new(align, 1).with_param_align(param_align);
        let plan = PartitionPlan::new(&one_bucket(&sizes), t, cfg).unwrap();
        let layout = plan.bucket(0).unwrap();
        let mut end = 0;
        for (p, &n) in layout.params.iter().zip(&sizes) {
            prop_assert_eq!(p.offset % param_align, 0);
            prop_assert!(p.offset >= end);
            prop_assert_eq!(p.numel, n);
            end = p.offset + n;
        }
        prop_assert!(layout.padded_len >= end);
        prop_assert_eq!(layout.padded_len % (world * align), 0);
        prop_assert_eq!(layout.is_packed(), end == layout.numel);
        let compact: Vec<f32> = (0..layout.numel).map(|i| i as f32 + 1.0).collect();
        let flat = layout.expand(&compact).unwrap();
        prop_assert_eq!(flat.iter().filter(|&&x| x != 0.0).count(), layout.numel);
        prop_assert_eq!(layout.compact(&flat).unwrap(), compact.clone());
        let tensors: Vec<&[f32]> =
            layout.compact_ranges().into_iter().map(|(_, r)| &compact[r]).collect();
        prop_assert_eq!(layout.flatten(&tensors).unwrap(), flat.clone());
        prop_assert_eq!(layout.unflatten(&flat).unwrap(), tensors);
        for r in 0..world {
            prop_assert_eq!(plan.shard_of(0, r, &compact).unwrap(), plan.shard_of(0, r, &flat).unwrap());
        }
    }
}

#[test]
fn a_group_never_holds_two_parameters() {
    // A LayerNorm gain (64) then a weight (4096) then a bias (64): with
    // param_align = group = 256 every group of 256 lies inside one parameter.
    let plan = PartitionPlan::new(
        &one_bucket(&[64, 4096, 64]),
        Topology::ranks(4).per_node(2).unwrap(),
        PlanConfig::new(256, 1).with_param_align(256),
    )
    .unwrap();
    let layout = plan.bucket(0).unwrap();
    for g in 0..layout.padded_len / 256 {
        let owners: Vec<usize> = layout
            .params
            .iter()
            .enumerate()
            .filter(|(_, p)| p.offset < (g + 1) * 256 && g * 256 < p.offset + p.numel)
            .map(|(i, _)| i)
            .collect();
        assert!(owners.len() <= 1, "group {g} holds parameters {owners:?}");
    }
}
