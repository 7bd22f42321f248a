"""Prints the headline metrics of an Nsight Compute details page (ncu -i R --page details
--csv), one line per metric, for each kernel in it.

    python3 bench/gpu/ncu_summary.py details.csv
"""
import csv
import sys

KEEP = ("Duration", "SM Frequency", "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput",
        "L1/TEX Cache Throughput", "L2 Cache Throughput", "Executed Ipc Active", "Issue Slots Busy",
        "Registers Per Thread", "Dynamic Shared Memory Per Block", "Achieved Occupancy", "Block Size", "Grid Size",
        "Cluster Size", "L2 Hit Rate", "Mem Busy", "Max Bandwidth", "Mem Pipes Busy", "No Eligible",
        "Active Warps Per Scheduler", "Eligible Warps Per Scheduler", "Warp Cycles Per Issued Instruction")


def main():
    rows = list(csv.DictReader(open(sys.argv[1])))
    kernel = None
    for r in rows:
        if r.get("Kernel Name") != kernel:
            kernel = r.get("Kernel Name")
            print(f"== {kernel[:160]}  grid {r.get('Grid Size')} block {r.get('Block Size')}")
        name = r.get("Metric Name", "")
        if name in KEEP or name.startswith("Stall") or "Pipe" in name:
            print(f"  {r.get('Section Name', '')[:24]:24s} {name:48s} {r.get('Metric Value', ''):>14s} {r.get('Metric Unit', '')}")


if __name__ == "__main__":
    main()
