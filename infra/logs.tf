# The gateway logs JSON lines (GATEWAY_LOG_FORMAT=json, with call_id) through the awslogs
# driver; the metrics sidecar writes its embedded-metric-format records to a second group,
# from which CloudWatch extracts gateway_calls_active for autoscaling.

resource "aws_cloudwatch_log_group" "gateway" {
  name              = "/ecs/${var.name}"
  retention_in_days = var.log_retention_days
}

resource "aws_cloudwatch_log_group" "metrics" {
  name              = "/ecs/${var.name}/prometheus-metrics"
  retention_in_days = var.log_retention_days
}
