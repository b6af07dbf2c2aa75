"""Where a kernel's time goes, by source line: ncu's per-instruction stall samples mapped back to
the CUDA source through the object's line table.

On the GPU machine (kernel built with -lineinfo, as csrc/build_ext.py does):

    ncu --clock-control none -k regex:dkdv_ws --launch-skip 1 --launch-count 1 --set full \\
        --import-source yes -o bwd python3 csrc/profile_ws.py 16 32768 2048
    ncu -i bwd.ncu-rep --page source --csv --print-source sass > bwd_sass.csv

Then here, with the object file of the same build:

    python tools/ncu_sass_lines.py BUILD/dualkv_bwd_ws_sm90.cuda.o bwd_sass.csv \\
        --kernel dkdv_ws_kernelI13__nv_bfloat16Li128ELb1ELb1ELi80E

prints the source lines with the most stall samples (share of all samples, top stall reasons,
executed instructions) and the executed opcode mix. cuobjdump / nvdisasm: $CUDA_HOME/bin, or the
copies Triton ships ($MDKV_CUDA_BIN overrides).
"""
import argparse
import collections
import csv
import os
import re
import shutil
import subprocess
import sys
import tempfile


def cuda_tool(name: str) -> str:
    for d in (os.environ.get("MDKV_CUDA_BIN"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin")):
        if d and os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    if shutil.which(name):
        return shutil.which(name)
    try:
        import triton
        d = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        if os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    except ImportError:
        pass
    sys.exit(f"{name} not found: set MDKV_CUDA_BIN")


def line_table(obj: str, kernel: str) -> dict:
    """SASS offset -> (file, line, instruction) of the one function whose name contains `kernel`."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([cuda_tool("cuobjdump"), "-xelf", "all", os.path.abspath(obj)], cwd=tmp, check=True,
                       capture_output=True)
        cubins = [f for f in os.listdir(tmp) if f.endswith(".cubin")]
        text = "".join(subprocess.run([cuda_tool("nvdisasm"), "-g", "-c", os.path.join(tmp, c)],
                                      capture_output=True, text=True).stdout for c in cubins)
    funcs = re.findall(r"^\.text\.(\S+):$", text, flags=re.M)
    hits = [f for f in funcs if kernel in f]
    if len(hits) != 1:
        sys.exit(f"--kernel {kernel!r} matches {len(hits)} functions: {hits[:8] or funcs[:8]}")
    body = text.split(f".text.{hits[0]}:", 1)[1].split("//---------------------", 1)[0]
    table, where = {}, ("?", 0)
    for line in body.split("\n"):
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = (os.path.basename(m.group(1)), int(m.group(2)))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            table[int(m.group(1), 16)] = (*where, m.group(2))
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("obj", help="object file of the profiled build (e.g. BUILD/dualkv_bwd_ws_sm90.cuda.o)")
    ap.add_argument("sass_csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--kernel", required=True, help="substring of the mangled kernel name")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    table = line_table(args.obj, args.kernel)
    rows = list(csv.reader(open(args.sass_csv)))
    hdr_i = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, data = rows[hdr_i], [r for r in rows[hdr_i + 1:] if r and r[0].startswith("0x")]
    col = {h: i for i, h in enumerate(hdr)}
    samples_i, executed_i = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]
    reasons = [(i, h[len("stall_"):]) for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    base = min(int(r[0], 16) for r in data)  # ncu prints absolute addresses; the line table has offsets
    samples, executed, why = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
    op_exec, op_samples = collections.Counter(), collections.Counter()
    for r in data:
        f, ln, ins = table.get(int(r[0], 16) - base, ("?", 0, r[1].strip()))
        s, n = float(r[samples_i] or 0), float(r[executed_i] or 0)
        samples[(f, ln)] += s
        executed[(f, ln)] += n
        for i, name in reasons:
            if r[i] and float(r[i]):
                why[(f, ln)][name] += float(r[i])
        words = ins.split()
        op = (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]
        op_exec[op] += n
        op_samples[op] += s
    total_s, total_n = sum(samples.values()) or 1, sum(executed.values()) or 1
    print(f"{total_s:.0f} stall samples, {total_n:.3g} warp instructions executed\n")
    print(" samples  executed  file:line  top stall reasons")
    for (f, ln), s in samples.most_common(args.top):
        top = ", ".join(f"{k} {v / s * 100:.0f}" for k, v in why[(f, ln)].most_common(3)) if s else ""
        print(f"{s / total_s * 100:7.1f}% {executed[(f, ln)] / total_n * 100:8.1f}%  {f}:{ln:<6} {top}")
    print("\nopcode     executed  samples")
    for op, n in op_exec.most_common(20):
        print(f"{op:10s} {n / total_n * 100:7.1f}% {op_samples[op] / total_s * 100:7.1f}%")


if __name__ == "__main__":
    main()
