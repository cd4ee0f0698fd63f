from cuda_agent.evaluate.plausibility import MemorySystem, below_speed_of_light, memory_system, speed_of_light_ms


def test_gpu_names_map_to_their_memory_systems():
    assert memory_system("NVIDIA H200") == MemorySystem(4800.0, 60.0)
    assert memory_system("NVIDIA H100 80GB HBM3 SXM").bandwidth_gbs == 3350.0
    assert memory_system("NVIDIA H100 PCIe").bandwidth_gbs == 2000.0  # the longer key wins over "H100"
    assert memory_system("NVIDIA H20").bandwidth_gbs == 4000.0
    assert memory_system("Some Future GPU") is None and memory_system(None) is None


def test_the_floor_counts_only_what_must_leave_the_l2():
    h200 = MemorySystem(4800.0, 60.0)
    assert speed_of_light_ms(50 * 2**20, h200) == 0.0  # fits in L2: no floor at all
    one_gib = 2**30
    floor = speed_of_light_ms(one_gib, h200)
    assert floor == (one_gib - 60 * 2**20) / 4800e9 * 1e3  # about 0.21 ms
    assert below_speed_of_light(floor, one_gib, h200) is None
    reason = below_speed_of_light(floor / 10, one_gib, h200)
    assert reason and "below the speed of light" in reason and "1024 MiB" in reason
    assert below_speed_of_light(1e-6, one_gib, None) is None  # unknown hardware: no claim
