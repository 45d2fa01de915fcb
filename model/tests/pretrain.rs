//! `make-model --train`: the trained target predicts the built-in language far above chance and
//! its greedy text follows the language instead of repeating the last token, as the same model
//! untrained does. Judged through the inference decoder, on held-out text.

use model::make::{make_model, MakeSpec};
use model::pretrain::{evaluate, TrainSpec};

#[test]
fn a_trained_target_follows_the_language_and_an_untrained_one_repeats() {
    let spec = MakeSpec {
        layers: 2,
        ..MakeSpec::default()
    };
    let random = tempfile::tempdir().unwrap();
    make_model(random.path(), &spec).unwrap();
    let before = evaluate(random.path(), 6).unwrap();
    let trained = tempfile::tempdir().unwrap();
    let spec = MakeSpec {
        train: Some(TrainSpec {
            steps: 400,
            ..TrainSpec::default()
        }),
        ..spec
    };
    let mut losses = Vec::new();
    model::make::make_model_reporting(trained.path(), &spec, &mut |_, l| losses.push(l)).unwrap();
    let after = evaluate(trained.path(), 6).unwrap();
    assert_eq!(losses.len(), 400);
    assert!(
        losses[399] < losses[0] * 0.6,
        "loss {} -> {}",
        losses[0],
        losses[399]
    );
    assert!(before.greedy_repeats > 0.5, "untrained: {before:?}");
    assert!(after.accuracy > 20.0 * after.chance, "trained: {after:?}");
    assert!(after.follows_chain > 0.3, "trained: {after:?}");
    assert!(after.greedy_repeats < 0.2, "trained: {after:?}");
    // A family it cannot train is refused before anything is written.
    let llama = MakeSpec {
        family: model::Family::Llama,
        ..spec
    };
    let err = make_model(&tempfile::tempdir().unwrap().path().join("m"), &llama).unwrap_err();
    assert!(err.to_string().contains("qwen3"), "{err}");
}
