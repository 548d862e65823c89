//! Measured bytes per rank per step equal the analytic model exactly, and
//! ZeRO++ cuts cross-node bytes to at most a quarter of ZeRO-3's on 2 nodes x 4.

use zeropp_engine::config::{CommDtype, HpzWire, QgzConfig, Routing, ZeroConfig, quant_spec};
use zeropp_engine::model::{GptConfig, MlpConfig};
use zeropp_run::train::{ModelChoice, train};

use super::accum_run as run;

#[test]
fn measured_bytes_equal_the_analytic_model() {
    let tiny = ModelChoice::Gpt(GptConfig::tiny());
    let mlp = ModelChoice::Mlp(MlpConfig::tiny());
    let z3 = ZeroConfig::zero3();
    let mut cases = vec![];
    for (w, l) in [(8, 4), (4, 2), (4, 1), (4, 4), (2, 1)] {
        let hpz = l;
        cases.push((w, l, z3));
        cases.push((w, l, ZeroConfig { comm_dtype: CommDtype::F32, ..z3 }));
        cases.push((w, l, ZeroConfig::zeropp(hpz)));
        cases.push((w, l, z3.with_qwz(ZeroConfig::default_qwz_spec())));
        cases.push((w, l, z3.with_hpz(hpz)));
        cases.push((w, l, z3.with_qgz(QgzConfig::default())));
    }
    let mut bits = ZeroConfig { hpz_size: 2, ..ZeroConfig::zeropp(4) };
    bits.qwz = Some(quant_spec("qwZ", 4, 256).unwrap());
    bits.qgz.as_mut().unwrap().spec = quant_spec("qgZ", 8, 256).unwrap();
    cases.push((8, 4, bits));
    cases.push((8, 4, ZeroConfig { prefetch: false, ..ZeroConfig::zeropp(4) }));
    // Flat routing, the INT8 hpZ wire, the 1-D exclusion, LoCo, packed groups.
    let flat = Routing::Flat;
    for (w, l) in [(8, 4), (6, 3), (4, 1)] {
        cases.push((w, l, ZeroConfig { routing: flat, ..z3 }));
        cases.push((w, l, ZeroConfig { routing: flat, ..ZeroConfig::zeropp(l) }));
        cases.push((w, l, ZeroConfig { hpz_wire: HpzWire::Int8, ..ZeroConfig::zeropp(l) }));
        cases.push((
            w,
            l,
            ZeroConfig {
                qgz: Some(QgzConfig {
                    exclude_1d: true,
                    ..QgzConfig::with_options(ZeroConfig::default_qgz_spec())
                }),
                ..ZeroConfig::zeropp(l)
            },
        ));
        cases.push((
            w,
            l,
            ZeroConfig {
                qgz: Some(QgzConfig {
                    error_feedback: Some(Default::default()),
                    ..QgzConfig::with_options(ZeroConfig::default_qgz_spec())
                }),
                per_tensor_groups: false,
                ..ZeroConfig::zeropp(l)
            },
        ));
    }
    for (i, (w, l, z)) in cases.into_iter().enumerate() {
        for accum in [1, 2] {
            let model = if i % 2 == 0 { tiny.clone() } else { mlp.clone() };
            let r = train(&run(w, l, z, accum, 3, model)).unwrap();
            let s = &r.summary;
            for rec in &r.steps {
                // Every step, not only the mean, matches.
                assert_eq!(
                    rec.intra_node_bytes, s.model_bytes_per_step.intra,
                    "case {i} {z:?} W={w} L={l} A={accum}"
                );
                assert_eq!(
                    rec.inter_node_bytes, s.model_bytes_per_step.inter,
                    "case {i} {z:?} W={w} L={l} A={accum}"
                );
                for (op, b) in &rec.bytes_by_op {
                    assert_eq!(
                        Some(b),
                        s.model_bytes_by_op.get(op),
                        "case {i} op {op} {z:?} W={w} L={l} A={accum}"
                    );
                }
            }
            assert_eq!(s.bytes_by_op, s.model_bytes_by_op, "case {i}");
        }
    }
}

/// Against the topology-aware (hierarchical) ZeRO-3 that NCCL or torch HSDP
/// would run, ZeRO++ sends a quarter of the cross-node bytes plus its scales and
/// headers; against a flat ZeRO-3 (every rank to every rank) it looks better
/// than that, which is why the flat ratio is only shown beside the fair one.
#[test]
fn zeropp_cross_node_bytes_about_a_quarter_of_hierarchical_zero3() {
    let model = ModelChoice::Gpt(GptConfig::default_small());
    let inter =
        |z: ZeroConfig| train(&run(8, 4, z, 1, 3, model.clone())).unwrap().summary.bytes_per_step.inter;
    let hier = inter(ZeroConfig::zero3());
    let flat = inter(ZeroConfig { routing: Routing::Flat, ..ZeroConfig::zero3() });
    let zpp = inter(ZeroConfig::zeropp_plain(4));
    let zpp_default = inter(ZeroConfig::zeropp(4));
    let (r_hier, r_flat) = (zpp / hier, zpp / flat);
    eprintln!(
        "cross-node bytes per rank per step: zero3 hierarchical {hier}, zero3 flat {flat}, zeropp {zpp} \
         (with the 1-D exclusion {zpp_default}); zeropp/zero3 = {r_hier:.4} (hierarchical), {r_flat:.4} (flat)"
    );
    // The default ZeRO++ also sends the 1-D parameters (1.4% of this small model)
    // at bf16 instead of INT4: a little more, still under 0.29.
    assert!(
        zpp_default > zpp && zpp_default / hier <= 0.29,
        "default zeropp / zero3 = {}",
        zpp_default / hier
    );
    // A hierarchical ZeRO-3 sends 3 * 2 bytes * s * (N-1) per layer across nodes,
    // flat sends (W-L)/(N-1) = L times that.
    assert!((flat / hier - 4.0).abs() < 0.02, "flat/hier = {}", flat / hier);
    assert!((0.25..=0.27).contains(&r_hier), "zeropp / hierarchical zero3 = {r_hier}");
    assert!(r_flat <= 0.07, "zeropp / flat zero3 = {r_flat}");
    // The backward gather never leaves the node with hpZ.
    let b = train(&run(8, 4, ZeroConfig::zeropp(4), 1, 3, model.clone())).unwrap();
    assert_eq!(b.summary.bytes_by_op["bwd_gather"].inter, 0.0);
}
