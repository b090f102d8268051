import pytest
import torch

from opswap.models.zoo_misc import RecurrentClassifier
from opswap.train import distill_rnn as D


def test_a_distilled_transformer_learns_the_rnn_teacher():
    torch.manual_seed(0)
    data = D.synthetic_sequences(n=384, length=7, features=3, classes=3, seed=1)
    teacher = RecurrentClassifier(3, 12, data.classes)  # zoo:seq's LSTM -> GRU classifier
    teacher_acc = D.train_teacher(teacher, data, steps=150, batch=32)
    student = D.student_for(teacher, 3, data.classes, length=7)
    n_t, n_s = D.parameters(teacher), D.parameters(student)
    assert abs(n_s - n_t) <= 0.35 * n_t, (n_s, n_t)  # a similar parameter count
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    r = D.distill(teacher, student, data, steps=120, batch=32, timed_batch=32, lr=5e-3)
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    assert r.teacher_accuracy == pytest.approx(teacher_acc) and teacher_acc >= 0.6
    assert r.student_accuracy_after >= r.student_accuracy_before + 0.15, r
    assert r.agreement_after > r.agreement_before and r.loss_last < r.loss_first, r
    assert r.speed_ratio == pytest.approx(r.teacher_ms / r.student_ms)
    assert not student.training and set(r.to_json()) >= {"speed_ratio", "student_accuracy_after"}


def test_bad_data_and_long_sequences_are_refused_in_one_sentence():
    student = D.SeqTransformer(3, 2, length=5, width=8, heads=4)
    with pytest.raises(D.DistillError, match="longer than the 5 positions"):
        student(torch.randn(2, 6, 3))
    with pytest.raises(D.DistillError, match="not a multiple of the 4 heads"):
        D.SeqTransformer(3, 2, length=5, width=10, heads=4)
    flat = D.Sequences(
        torch.randn(4, 3),
        torch.zeros(4, dtype=torch.long),
        torch.randn(2, 3),
        torch.zeros(2, dtype=torch.long),
    )
    with pytest.raises(D.DistillError, match=r"sequences \[N, T, F\]"):
        D.distill(RecurrentClassifier(3, 4, 2), student, flat, steps=1)
