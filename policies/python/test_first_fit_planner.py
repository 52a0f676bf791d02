"""Unit tests of the first-fit planner's logic: ``python3 -m unittest`` in this folder."""

import random
import unittest

import first_fit_planner_logic as logic


class FirstFitPlannerTest(unittest.TestCase):
    def test_a_freed_block_is_reused(self):
        # 0 and 1 overlap; 2 comes after 0's free and takes its place; 3 has no known end.
        reqs = [(1000, 2, None), (2048, 3, None), (1024, 4, None), (512, None, None)]
        arena, offsets = logic.plan(reqs)
        self.assertEqual(offsets, [0, 1024, 0, None])
        self.assertEqual(arena, 3072)
        logic.validate(reqs, arena, offsets)

    def test_wrapping_requests_get_the_bottom(self):
        # 2 is live at the end and wraps to time 1 of the next step.
        reqs = [(512, 1, None), (512, 2, None), (1024, None, 1), (512, None, 0)]
        arena, offsets = logic.plan(reqs)
        self.assertEqual(offsets[2], 0)
        self.assertEqual(offsets[0], 1024)
        self.assertIsNotNone(offsets[3])  # wraps to 0: lives [3, 4) only
        logic.validate(reqs, arena, offsets)

    def test_a_late_wrap_is_not_planned(self):
        arena, offsets = logic.plan([(512, None, 5), (512, 1, None)])
        self.assertEqual(offsets, [None, 0])
        self.assertEqual(arena, 512)

    def test_random_profiles_give_valid_plans(self):
        rng = random.Random(7)
        for _ in range(200):
            n = rng.randrange(1, 80)
            reqs = []
            for k in range(n):
                freed = min(n, k + 1 + rng.randrange(12)) if rng.random() < 0.8 else None
                wraps = rng.randrange(n) if freed is None and rng.random() < 0.6 else None
                reqs.append((rng.randrange(1, 1 << 20), freed, wraps))
            arena, offsets = logic.plan(reqs)
            logic.validate(reqs, arena, offsets)
            for k, ((_, f, w), off) in enumerate(zip(reqs, offsets)):
                self.assertEqual(off is not None, logic.plannable(f, w, k))

    def test_the_validator_refuses_bad_plans(self):
        reqs = [(512, 2, None), (512, 2, None)]
        with self.assertRaises(ValueError):
            logic.validate(reqs, 1024, [0, 0])  # overlap
        with self.assertRaises(ValueError):
            logic.validate(reqs, 1024, [0, 7])  # unaligned
        with self.assertRaises(ValueError):
            logic.validate(reqs, 512, [0, 512])  # outside
        with self.assertRaises(ValueError):
            logic.validate(reqs, 1024, [0])  # wrong length


if __name__ == "__main__":
    unittest.main()
