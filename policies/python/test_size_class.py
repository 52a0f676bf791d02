"""Unit tests of the size-class logic: ``python3 -m unittest`` in this folder."""

import unittest

import size_class_logic as logic
from size_class_logic import MIB


def power_of_two(v):
    return v > 0 and v & (v - 1) == 0


class SizeClassTest(unittest.TestCase):
    def test_pools_by_class(self):
        c = logic.Config()
        self.assertEqual(logic.decide(c, 1)["pool"], 0)
        self.assertEqual(logic.decide(c, MIB - 1)["pool"], 0)
        self.assertEqual(logic.decide(c, MIB)["pool"], 1)
        self.assertEqual(logic.decide(c, 16 * MIB - 1)["pool"], 1)
        d = logic.decide(c, 40 * MIB)
        self.assertEqual((d["pool"], d["segment_min"], d["max_waste"]), (2, 0, 8 * MIB))

    def test_decision_is_a_function_of_the_class(self):
        c = logic.Config()
        for k in range(0, 64):
            low, high = 1 << k, (1 << (k + 1)) - 1
            self.assertEqual(logic.decide(c, low), logic.decide(c, high), k)

    def test_decisions_are_valid(self):
        c = logic.Config()
        for k in range(0, 64):
            d = logic.decide(c, 1 << k)
            self.assertTrue(d["pool"] < len(logic.POOL_NAMES))
            self.assertTrue(power_of_two(d["round_to"]) and power_of_two(d["segment_round"]))
            self.assertTrue(d["split_min_remainder"] >= 1)
            self.assertTrue(d["cacheable"])
            for v in d.values():
                self.assertTrue(0 <= v <= logic.U64_MAX)

    def test_config(self):
        c = logic.parse_config("medium_from=512KiB, large_from=64MiB medium_segment=8MiB")
        self.assertEqual((c.medium_from, c.large_from, c.medium_segment), (512 * 1024, 64 * MIB, 8 * MIB))
        self.assertEqual(logic.decide(c, 600 * 1024)["pool"], 1)
        self.assertEqual(logic.parse_config("").large_from, 16 * MIB)
        for bad in ["x", "large_from=3MiB", "medium_from=32MiB", "colour=red", "a=1,a=1", "medium_segment=1.5MiB"]:
            with self.assertRaises(ValueError, msg=bad):
                logic.parse_config(bad)


if __name__ == "__main__":
    unittest.main()
