set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
for s in paged naive virtual; do
  python3 llama3_$s.py 49 --random-weights --json $OUT/new_$s.json > $OUT/new_$s.log 2>&1; echo "new $s rc=$?"
  (cd .old && python3 llama3_$s.py 49 --random-weights --json $OUT/old_$s.json > $OUT/old_$s.log 2>&1; echo "old $s rc=$?")
done
timeout 200 python3 -m pytest -q tests/test_gpu.py -x > $OUT/gpu_suite.log 2>&1; echo "gpu suite rc=$?"; tail -3 $OUT/gpu_suite.log
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for s in ["paged", "naive", "virtual"]:
    try:
        new = [r["output_tokens"] for r in json.load(open(f"{out}/new_{s}.json"))["requests"]]
        old = [r["output_tokens"] for r in json.load(open(f"{out}/old_{s}.json"))["requests"]]
        print(s, sum(a == b for a, b in zip(new, old)), "of", len(old), "same as old")
    except Exception as e:
        print(s, "no comparison:", e)
PY
