#!/usr/bin/env bash
# Regenerate deploy/kubernetes/monitoring/prometheusrule.yaml from deploy/prometheus/epochfs-rules.yml:
# the same rules, as the Prometheus Operator's PrometheusRule (the monitoring overlays ship it).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python - > deploy/kubernetes/monitoring/prometheusrule.yaml <<'PY'
import yaml

rules = yaml.safe_load(open("deploy/prometheus/epochfs-rules.yml"))
print("# The alert and recording rules of deploy/prometheus/epochfs-rules.yml for the Prometheus Operator.")
print("# Generated: bash scripts/prometheus-rule.sh (a test keeps it equal to the rules file).")
print(yaml.safe_dump({"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
                      "metadata": {"name": "epochfs", "labels": {"app.kubernetes.io/name": "epochfs"}},
                      "spec": {"groups": rules["groups"]}}, sort_keys=False, width=120), end="")
PY
