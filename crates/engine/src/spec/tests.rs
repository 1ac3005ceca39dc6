use super::*;
use crate::kv::NO_PARENT;

fn flat_cost() -> CostModel {
    // A GPU-like backend: a pass costs the same up to 64 tokens.
    let mut c = CostModel::default();
    c.observe(1, 0.010);
    c.observe(64, 0.010);
    c
}

fn linear_cost() -> CostModel {
    // Every token as expensive as a step: speculation can never pay.
    let mut c = CostModel::default();
    c.observe(1, 0.010);
    c.observe(64, 0.640);
    c
}

fn pass() -> PassShape {
    PassShape {
        base: 1,
        decisions: 1.0,
        room: 64,
    }
}

fn props() -> Proposals {
    let mut p = Proposals::default();
    // Three sources agree on 10 11 12 13 ..., one goes 10 20 21, one 30.
    for _ in 0..3 {
        p.add(&[10, 11, 12, 13, 14, 15, 16, 17, 18, 19], 1.0, 4);
    }
    p.add(&[10, 20, 21], 1.0, 1);
    p.add(&[30, 31], 1.0, 0);
    p
}

fn check_shape(t: &DraftTree) {
    for i in 0..t.len() {
        let p = t.parents[i];
        if p != NO_PARENT {
            assert!((p as usize) < i, "parents come first");
        }
        // Depth-first: a node's first child comes right after it.
        if let Some(c) = (i + 1..t.len()).find(|&c| t.parents[c] == i as u32) {
            assert_eq!(c, i + 1, "first child of {i} is stored after it");
        }
    }
}

#[test]
fn trees_are_best_first_depth_first_and_within_budget() {
    let cfg = SpecConfig {
        max_nodes: 7,
        ..SpecConfig::default()
    };
    let mut b = Builder::default();
    let mut t = DraftTree::default();
    b.build(
        &props(),
        None,
        &cfg,
        &Calibration::default(),
        &flat_cost(),
        pass(),
        &mut t,
    )
    .unwrap();
    assert_eq!(t.len(), 7);
    check_shape(&t);
    // The likeliest path is stored first, in place.
    assert_eq!(&t.tokens[..4], &[10, 11, 12, 13]);
    assert_eq!(&t.parents[..4], &[NO_PARENT, 0, 1, 2]);
    // Top-2 at the root: the second child of the root is 30.
    let roots: Vec<_> = (0..t.len())
        .filter(|&i| t.parents[i] == NO_PARENT)
        .map(|i| t.tokens[i])
        .collect();
    assert_eq!(roots, vec![10, 30]);
    assert!(t.child(None, 30).is_some() && t.child(Some(0), 11) == Some(1));
    // Probabilities fall along a path.
    assert!(t.prob[0] >= t.prob[1] && t.prob[1] >= t.prob[2]);
}

#[test]
fn depth_and_room_limit_the_tree() {
    let cfg = SpecConfig {
        max_depth: 3,
        ..SpecConfig::default()
    };
    let mut b = Builder::default();
    let mut t = DraftTree::default();
    let c = Calibration::default();
    b.build(&props(), None, &cfg, &c, &flat_cost(), pass(), &mut t)
        .unwrap();
    assert!(t.depth.iter().all(|&d| d < 3), "{:?}", t.depth);
    let small = PassShape { room: 2, ..pass() };
    b.build(&props(), None, &cfg, &c, &flat_cost(), small, &mut t)
        .unwrap();
    assert_eq!(t.len(), 2);
}

#[test]
fn tree_size_follows_the_cost_of_verification() {
    let mut b = Builder::default();
    let mut t = DraftTree::default();
    let cfg = SpecConfig::default();
    let c = Calibration::default();
    b.build(&props(), None, &cfg, &c, &flat_cost(), pass(), &mut t)
        .unwrap();
    let flat = t.len();
    // Everything proposed within 8 drafted levels: 10..=17, 20 21, 30 31.
    assert_eq!(flat, 12, "a free verifier takes all it is offered");
    b.build(&props(), None, &cfg, &c, &linear_cost(), pass(), &mut t)
        .unwrap();
    assert!(
        t.is_empty(),
        "a verifier as costly as decoding gets no tree"
    );
    // The CPU prior (half a step per extra token) keeps a short, likely chain.
    b.build(
        &props(),
        None,
        &cfg,
        &c,
        &CostModel::default(),
        pass(),
        &mut t,
    )
    .unwrap();
    assert!(t.len() < flat, "{}", t.len());
    // A fixed shape ignores the cost.
    let fixed = SpecConfig {
        adaptive: false,
        ..SpecConfig::chain(3)
    };
    b.build(&props(), None, &fixed, &c, &linear_cost(), pass(), &mut t)
        .unwrap();
    assert_eq!(t.tokens, vec![10, 11, 12]);
}

#[test]
fn cost_model_interpolates_and_extrapolates() {
    let mut c = CostModel::default();
    assert_eq!(c.cost(1), 1.0);
    assert_eq!(c.cost(3), 2.0);
    c.observe(1, 0.01);
    c.observe(5, 0.03);
    assert!((c.cost(3) - 0.02).abs() < 1e-12);
    assert!((c.cost(9) - 0.05).abs() < 1e-12);
    c.observe(5, 0.08);
    assert!(
        (c.cost(5) - 0.04).abs() < 1e-12,
        "an average of recent passes"
    );
}

#[test]
fn a_fixed_cost_model_ignores_measurements() {
    let f = FixedCost {
        step: 1.0,
        token: 0.25,
    };
    let mut c = CostModel::fixed(f);
    assert!(c.is_fixed());
    c.observe(1, 50.0);
    c.set(4, 50.0);
    assert_eq!(
        (c.cost(1), c.cost(4), c.cost(200)),
        (1.0, 1.75, 1.0 + 0.25 * 95.0 + 0.25 * 104.0)
    );
    let cfg = SpecConfig {
        fixed_cost: Some(f),
        ..SpecConfig::default()
    };
    assert_eq!(Speculator::new(cfg).cost.cost(4), 1.75);
    assert!(!Speculator::new(SpecConfig::default()).cost.is_fixed());
}

#[test]
fn calibration_learns_acceptance() {
    let mut c = Calibration::default();
    let prior = c.rate(2, 0);
    for i in 0..200 {
        c.record(2, 0, i % 10 == 0);
    }
    assert!(c.rate(2, 0) < prior && (c.rate(2, 0) - 0.1).abs() < 0.03);
    assert_eq!(c.rate(3, 0), Calibration::default().rate(3, 0));
}
