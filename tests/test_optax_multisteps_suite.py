"""optax's own MultiSteps tests, run with `jaccum.MultiSteps` in place of optax's.

The tests ship inside the optax wheel (`optax/transforms/_accumulation_test.py`)
and reach the class as `_accumulation.MultiSteps`; here that name points at
jaccum's class for the duration of each test. The suite's other tests (`ema`,
`skip_not_finite`, ...) check optax functions that jaccum does not replace, so
they are left out. No MultiSteps case is excluded: jaccum's deliberate changes
(inner update only on the emitting call, `where` reset, `has_updated` false
after a skipped call) keep every behaviour these tests check.
"""

import types

from optax.transforms import _accumulation
from optax.transforms import _accumulation_test as suite

import jaccum

# `_accumulation` with MultiSteps swapped; everything else (skip_not_finite, ...)
# stays optax's.
_with_jaccum = types.ModuleType("_accumulation_with_jaccum")
_with_jaccum.__dict__.update(vars(_accumulation))
_with_jaccum.MultiSteps = jaccum.MultiSteps
_with_jaccum.MultiStepsState = jaccum.MultiStepsState


class TestOptaxMultiStepsSuite(suite.AccumulationTest):
  """optax's AccumulationTest, MultiSteps cases only, against jaccum.MultiSteps."""

  def setUp(self):
    super().setUp()
    original = suite._accumulation
    suite._accumulation = _with_jaccum
    self.addCleanup(setattr, suite, "_accumulation", original)


for _name in dir(suite.AccumulationTest):
  if _name.startswith("test") and not _name.startswith("test_multi_steps"):
    setattr(TestOptaxMultiStepsSuite, _name, None)  # unittest collects callables only


def test_suite_runs_the_multisteps_cases_against_jaccum():
  """Guards against the suite silently shrinking or the swap not taking effect."""
  names = [
    name
    for name in dir(TestOptaxMultiStepsSuite)
    if name.startswith("test_multi_steps")
    and callable(getattr(TestOptaxMultiStepsSuite, name))
  ]
  assert len(names) >= 8, names
  case = TestOptaxMultiStepsSuite(names[0])
  case.setUp()
  try:
    assert suite._accumulation.MultiSteps is jaccum.MultiSteps
  finally:
    case.doCleanups()
  assert suite._accumulation is _accumulation
