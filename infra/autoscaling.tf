# Scaling on active calls per task.
#
# How the metric is produced: the gateway exposes gateway_calls_active{transport,line} on
# /metrics (Prometheus). A CloudWatch agent sidecar in the same task (host network, so it
# scrapes 127.0.0.1:<container_port>) reads it every minute and writes embedded-metric-format
# records to the metrics log group; CloudWatch turns them into the metric
# <metrics_namespace>/gateway_calls_active with dimensions ClusterName and ServiceName (added
# as static scrape labels). It scrapes gateway_tts_engines_healthy too: an unlabelled gauge, so
# exactly one sample per task per scrape, which counts the tasks reporting.
#
# Per-task average = Sum(calls samples) / SampleCount(task samples) over the same minute: the
# transport and line labels make one series per transport and line, so an Average of
# gateway_calls_active would divide by tasks x series; both metrics come from the same scrapes,
# so the ratio is exact whatever the scrape alignment. Target tracking keeps it near target_calls_per_task.
#
# Why not ALB metrics: ActiveConnectionCount is per load balancer (not per target) and counts
# webhook connections too; RequestCountPerTarget counts one request per call (the upgrade) no
# matter how long the call lasts; neither sees SIP calls.

locals {
  scaling_metrics = {
    calls = "gateway_calls_active"
    tasks = "gateway_tts_engines_healthy"
  }

  prometheus_scrape_config = {
    global = {
      scrape_interval = "1m"
      scrape_timeout  = "10s"
    }
    scrape_configs = [
      {
        job_name     = "ivr-gateway"
        metrics_path = "/metrics"
        static_configs = [
          {
            targets = ["127.0.0.1:${var.container_port}"]
            labels = {
              ClusterName = local.cluster_name
              ServiceName = local.service_name
            }
          },
        ]
      },
    ]
  }

  cloudwatch_agent_config = {
    logs = {
      metrics_collected = {
        prometheus = {
          log_group_name         = aws_cloudwatch_log_group.metrics.name
          prometheus_config_path = "env:PROMETHEUS_CONFIG_CONTENT"
          emf_processor = {
            metric_namespace = var.metrics_namespace
            metric_declaration = [
              {
                source_labels    = ["job"]
                label_matcher    = "^ivr-gateway$"
                dimensions       = [["ClusterName", "ServiceName"]]
                metric_selectors = [for name in values(local.scaling_metrics) : "^${name}$"]
              },
            ]
          }
        }
      }
      force_flush_interval = 5
    }
  }

  metrics_agent_container = {
    name              = "cloudwatch-agent"
    image             = var.cloudwatch_agent_image
    essential         = false # losing metrics must not stop calls
    cpu               = 128
    memoryReservation = 256
    environment = [
      { name = "CW_CONFIG_CONTENT", value = jsonencode(local.cloudwatch_agent_config) },
      { name = "PROMETHEUS_CONFIG_CONTENT", value = yamlencode(local.prometheus_scrape_config) },
    ]
    logConfiguration = {
      logDriver = "awslogs"
      options = {
        "awslogs-group"         = aws_cloudwatch_log_group.gateway.name
        "awslogs-region"        = var.region
        "awslogs-stream-prefix" = "cloudwatch-agent"
      }
    }
  }
}

resource "aws_appautoscaling_target" "service" {
  service_namespace  = "ecs"
  resource_id        = "service/${aws_ecs_cluster.this.name}/${aws_ecs_service.gateway.name}"
  scalable_dimension = "ecs:service:DesiredCount"
  min_capacity       = var.min_replicas
  max_capacity       = var.max_replicas
}

resource "aws_appautoscaling_policy" "calls_per_task" {
  name               = "${var.name}-calls-per-task"
  policy_type        = "TargetTrackingScaling"
  service_namespace  = aws_appautoscaling_target.service.service_namespace
  resource_id        = aws_appautoscaling_target.service.resource_id
  scalable_dimension = aws_appautoscaling_target.service.scalable_dimension

  target_tracking_scaling_policy_configuration {
    target_value       = var.target_calls_per_task
    scale_out_cooldown = var.scale_out_cooldown_s
    scale_in_cooldown  = var.scale_in_cooldown_s

    customized_metric_specification {
      metrics {
        id          = "calls"
        label       = "Active calls, all tasks and transports"
        return_data = false
        metric_stat {
          stat = "Sum"
          metric {
            namespace   = var.metrics_namespace
            metric_name = local.scaling_metrics.calls
            dimensions {
              name  = "ClusterName"
              value = local.cluster_name
            }
            dimensions {
              name  = "ServiceName"
              value = local.service_name
            }
          }
        }
      }

      metrics {
        id          = "tasks"
        label       = "Task samples (one per task per scrape)"
        return_data = false
        metric_stat {
          stat = "SampleCount"
          metric {
            namespace   = var.metrics_namespace
            metric_name = local.scaling_metrics.tasks
            dimensions {
              name  = "ClusterName"
              value = local.cluster_name
            }
            dimensions {
              name  = "ServiceName"
              value = local.service_name
            }
          }
        }
      }

      metrics {
        id          = "calls_per_task"
        label       = "Active calls per task"
        expression  = "calls / tasks"
        return_data = true
      }
    }
  }
}
