//! Property tests of the partition plan over random shapes and topologies.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use proptest::prelude::*;
use zeropp_comm::Topology;
use zeropp_partition::{DType, MemoryReport, ParamRegistry, ParamSpec, PartitionPlan, PlanConfig};

/// (registry, world, local_size, align, hpz)
fn scenario() -> impl Strategy<Value = (ParamRegistry, usize, usize, usize, usize)> {
    let shape = prop::collection::vec(0usize..6, 0..4);
    let bucket = prop::collection::vec(shape, 0..4);
    let buckets = prop::collection::vec(bucket, 1..4);
    (buckets, 1usize..5, 1usize..5, 1usize..9, any::<prop::sample::Index>()).prop_map(
        |(buckets, nodes, local, align, hpz_pick)| {
            let mut reg = ParamRegistry::new();
            for (b, params) in buckets.into_iter().enumerate() {
                let specs = params
                    .into_iter()
                    .enumerate()
                    .map(|(i, shape)| ParamSpec::new(format!("b{b}.p{i}"), shape, DType::BF16))
                    .collect();
                reg.push_bucket(format!("b{b}"), specs).unwrap();
            }
            let divisors: Vec<usize> = (1..=local).filter(|d| local % d == 0).collect();
            let hpz = divisors[hpz_pick.index(divisors.len())];
            (reg, nodes * local, local, align, hpz)
        },
    )
}

fn build(s: &(ParamRegistry, usize, usize, usize, usize)) -> PartitionPlan {
    let (reg, world, local, align, hpz) = s;
    PartitionPlan::new(reg, Topology::ranks(*world).per_node(*local).unwrap(), PlanConfig::new(*align, *hpz))
        .unwrap()
}

fn full_bucket(plan: &PartitionPlan, b: usize) -> Vec<f32> {
    let layout = plan.bucket(b).unwrap();
    (0..layout.padded_len).map(|i| if i < layout.numel { i as f32 + 0.25 } else { 0.0 }).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn primary_shards_are_disjoint_and_cover(s in scenario()) {
        let plan = build(&s);
        let world = plan.world();
        let align = plan.config().align;
        for b in 0..plan.num_buckets() {
            let layout = plan.bucket(b).unwrap();
            prop_assert!(layout.padded_len >= layout.numel);
            prop_assert_eq!(layout.padded_len % (world * align), 0);
            prop_assert!(layout.padded_len - layout.numel < world * align);
            // params tile 0..numel without overlap
            let mut next = 0;
            for p in &layout.params {
                prop_assert_eq!(p.offset, next);
                next += p.numel;
            }
            prop_assert_eq!(next, layout.numel);
            // primary shards tile 0..padded_len in rank order
            let mut covered = vec![0u32; layout.padded_len];
            let mut prev_end = 0;
            for r in 0..world {
                let range = plan.primary_range(r, b).unwrap();
                prop_assert_eq!(range.start, prev_end);
                prop_assert_eq!(range.len() % align, 0);
                prev_end = range.end;
                for i in range {
                    covered[i] += 1;
                }
            }
            prop_assert_eq!(prev_end, layout.padded_len);
            prop_assert!(covered.iter().all(|&c| c == 1));
        }
    }

    #[test]
    fn partition_then_gather_is_identity(s in scenario()) {
        let plan = build(&s);
        for b in 0..plan.num_buckets() {
            let full = full_bucket(&plan, b);
            let shards = plan.partition(b, &full).unwrap();
            for (r, sh) in shards.iter().enumerate() {
                prop_assert_eq!(sh.as_slice(), &full[plan.primary_range(r, b).unwrap()]);
            }
            prop_assert_eq!(plan.gather(b, &shards).unwrap(), full);
        }
    }

    #[test]
    fn secondary_shards_consistent_with_primaries(s in scenario()) {
        let plan = build(&s);
        let (t, hpz) = (plan.topology(), plan.config().hpz);
        for b in 0..plan.num_buckets() {
            let full = full_bucket(&plan, b);
            let gathered = plan.gather(b, &plan.partition(b, &full).unwrap()).unwrap();
            for r in 0..plan.world() {
                let group = plan.hpz_group(r).unwrap();
                prop_assert_eq!(group.ranks.len(), hpz);
                prop_assert_eq!(group.ranks[group.index], r);
                prop_assert!(group.ranks.iter().all(|&g| t.same_node(g, r)));
                prop_assert!(group.ranks.windows(2).all(|w| w[1] == w[0] + 1));
                match plan.secondary_range(r, b).unwrap() {
                    None => prop_assert_eq!(hpz, 1),
                    Some(range) => {
                        prop_assert!(hpz > 1);
                        prop_assert_eq!(range.len() * hpz, gathered.len());
                        // the secondary values are those of the gathered primaries
                        let secondary = &gathered[range.clone()];
                        prop_assert_eq!(secondary, &full[range]);
                        // the group's secondaries, in group order, are the full bucket
                        let mut rebuilt = Vec::new();
                        for &g in &group.ranks {
                            rebuilt.extend_from_slice(
                                &gathered[plan.secondary_range(g, b).unwrap().unwrap()],
                            );
                        }
                        prop_assert_eq!(&rebuilt, &full);
                    }
                }
            }
        }
    }

    #[test]
    fn qgz_order_is_a_permutation_routing_to_owners(s in scenario()) {
        let plan = build(&s);
        let t = plan.topology();
        let order = plan.qgz_slice_order();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        prop_assert_eq!(sorted, (0..plan.world()).collect::<Vec<_>>());
        for l in 0..t.local_size() {
            let shards = plan.qgz_peer_shards(l).unwrap();
            prop_assert_eq!(&order[l * t.nodes()..(l + 1) * t.nodes()], shards.as_slice());
            for (m, &owner) in shards.iter().enumerate() {
                // sub-chunk m of peer l's reduced data goes to node m: its owner is (m, l)
                prop_assert_eq!(t.node_of(owner), m);
                prop_assert_eq!(t.local_rank(owner), l);
            }
        }
        for b in 0..plan.num_buckets() {
            let ranges = plan.qgz_reordered_ranges(b).unwrap();
            for (p, &owner) in order.iter().enumerate() {
                prop_assert_eq!(ranges[p].clone(), plan.primary_range(owner, b).unwrap());
            }
        }
    }

    #[test]
    fn memory_report_formula_holds(s in scenario()) {
        let plan = build(&s);
        let psi = plan.padded_numel();
        for r in 0..plan.world() {
            let m = plan.memory_report(r).unwrap();
            prop_assert_eq!(
                m.total_bytes(),
                MemoryReport::formula(psi, plan.world(), plan.config().hpz)
            );
            prop_assert_eq!(m.primary_elems * plan.world(), psi);
        }
    }

    #[test]
    fn shard_pieces_cover_the_real_part_of_each_shard(s in scenario()) {
        let plan = build(&s);
        for b in 0..plan.num_buckets() {
            let layout = plan.bucket(b).unwrap();
            let full = full_bucket(&plan, b);
            for r in 0..plan.world() {
                let shard = plan.shard_of(b, r, &full).unwrap();
                let prim = plan.primary_range(r, b).unwrap();
                let mut covered = vec![false; shard.len()];
                for piece in plan.shard_pieces(r, b).unwrap() {
                    let slot = &layout.params[piece.param];
                    prop_assert!(!piece.in_shard.is_empty());
                    prop_assert_eq!(piece.in_shard.len(), piece.in_param.len());
                    prop_assert_eq!(
                        &shard[piece.in_shard.clone()],
                        &full[slot.offset + piece.in_param.start..slot.offset + piece.in_param.end]
                    );
                    for i in piece.in_shard {
                        prop_assert!(!covered[i]);
                        covered[i] = true;
                    }
                }
                for (i, c) in covered.iter().enumerate() {
                    prop_assert_eq!(*c, prim.start + i < layout.numel);
                }
            }
        }
    }
}
