"""The members clients may use of an evaluator (``EvaluatorLike``) are what ``Evaluator`` offers."""

import inspect

from cuda_agent.evaluate import Evaluator
from cuda_agent.evaluate.interface import EvaluatorLike


def test_evaluator_satisfies_the_client_interface_with_the_same_signatures():
    evaluator = Evaluator("cpu", sandbox="none")
    assert isinstance(evaluator, EvaluatorLike)
    for name, member in vars(EvaluatorLike).items():
        if callable(member) and not name.startswith("_"):
            wanted = inspect.signature(member)
            offered = inspect.signature(getattr(Evaluator, name))
            assert list(wanted.parameters) == list(offered.parameters)[:len(wanted.parameters)], name
            assert all(offered.parameters[p].default == wanted.parameters[p].default for p in wanted.parameters), name


def test_something_without_verify_is_not_an_evaluator():
    class OnlyEvaluates:
        device, policy, timing = "cpu", None, None

        def evaluate(self, task, candidate):
            return None

    assert not isinstance(OnlyEvaluates(), EvaluatorLike)
