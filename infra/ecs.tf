# The ECS cluster, the gateway task definition and the service.
#
# Network mode: host. Neither awsvpc nor bridge can carry SIP/RTP here:
# - awsvpc tasks on the EC2 launch type get no public IP, and RTP must reach the task directly
#   at the address the gateway puts in its SDP;
# - bridge maps a containerPortRange to *dynamic* host ports, so the RTP port the gateway
#   advertises (its container port) is not the one the trunk could reach.
# With host networking the gateway binds the host's ports itself: HTTP, SIP 5060 and the RTP
# range, with no port mapping per RTP port. The price - one gateway task per host, since every
# task binds the same ports - costs nothing here, because each task reserves the host's only GPU
# anyway (instance_type is validated to be a single-GPU size). Security groups apply to the host
# (security_groups.tf). Load balancer targets are instances (target_type "instance").

resource "aws_ecs_cluster" "this" {
  name = local.cluster_name

  setting {
    name  = "containerInsights"
    value = var.container_insights ? "enabled" : "disabled"
  }
}

resource "aws_ecs_cluster_capacity_providers" "this" {
  cluster_name       = aws_ecs_cluster.this.name
  capacity_providers = [aws_ecs_capacity_provider.gpu.name]

  default_capacity_provider_strategy {
    capacity_provider = aws_ecs_capacity_provider.gpu.name
    weight            = 1
  }
}

locals {
  # ECS's ceiling on stopTimeout: SIGKILL follows SIGTERM after this. The gateway's drain grace
  # (GATEWAY_DRAIN_GRACE_S, validated <= 115) fits inside it.
  stop_timeout_s = 120

  # --- rolling deployments that cannot deadlock on GPU ownership -----------------------------
  # Each task holds its host's only GPU. ECS keeps at least ceil(N * minimum_healthy / 100)
  # tasks running and runs at most floor(N * maximum / 100) during a deployment of N tasks, so
  # it makes progress only if it may stop one old task first (ceil(N * min / 100) < N) or start
  # one new task first (floor(N * max / 100) > N) - with capacity for it. The reference
  # deployment ran min 100 / max 100 on one GPU: neither was allowed and the rollout stalled.
  # Both strategies below satisfy the rule for every N >= min_replicas (the service's
  # precondition re-checks it; tests/test_infra.py evaluates it for many fleet sizes).
  deployment_percents = {
    # Start each replacement first: managed scaling adds a host for it, the old task is stopped
    # once the new one passes /readyz. No capacity dip, but a spare GPU host per replaced task
    # for the rollout, and a rollout waits while the zone has no GPU capacity to give.
    # 100 + ceil(100 / min_replicas) lets it start at least one task at the smallest fleet size.
    surge = {
      minimum_healthy = 100
      maximum         = 100 + ceil(100 / var.min_replicas)
    }
    # Stop an old task first (after its drain), then start the new one on the freed GPU. No
    # extra host; one task's capacity is missing for each step, and with one replica no new
    # call is answered until the new task is ready (model load: minutes).
    stop_first = {
      minimum_healthy = floor(100 * (var.min_replicas - 1) / var.min_replicas)
      maximum         = 100
    }
  }
  deployment_minimum_healthy_percent = local.deployment_percents[var.deployment_strategy].minimum_healthy
  deployment_maximum_percent         = local.deployment_percents[var.deployment_strategy].maximum

  # --- the gateway container ---------------------------------------------------------------
  # Plain settings only; secrets come through `secrets` below. The names are real Settings
  # fields (gateway/config.py; tests/test_infra.py checks every GATEWAY_* name). The image
  # (Dockerfile) already sets the baked-in model, IVR script, prompt cache and voices paths;
  # they are only overridden when a variable asks for it.
  gateway_environment = {
    GATEWAY_HOST          = "0.0.0.0"
    GATEWAY_PORT          = tostring(var.container_port)
    GATEWAY_DEVICE        = "cuda" # fail loudly on a host without a GPU rather than run on CPU
    GATEWAY_PUBLIC_URL    = local.public_url
    GATEWAY_LOG_FORMAT    = "json"
    GATEWAY_DRAIN_GRACE_S = tostring(var.drain_grace_s)
    GATEWAY_MAX_CALLS     = tostring(var.max_calls_per_task)
    # The ALB sends a call's stream to any task, so the task answering the voice webhook holds
    # no seat for it (it would be a phantom seat on every other task): each task admits the
    # streams it gets against its own GATEWAY_MAX_CALLS (docs/operators/fleet.md).
    GATEWAY_TWILIO_RESERVATION_S = "0"
  }
  sip_environment = {
    GATEWAY_SIP       = "0.0.0.0:${local.sip_port}"
    GATEWAY_SIP_ALLOW = join(",", var.sip_trunk_cidrs)
    GATEWAY_RTP_PORTS = "${var.rtp_port_min}-${var.rtp_port_max}"
    # GATEWAY_SIP_PUBLIC_IP is the host's public IPv4, different per host: the entry point
    # below looks it up in the instance metadata at start.
  }
  optional_environment = {
    GATEWAY_MODEL              = var.model_id
    GATEWAY_SCRIPT             = var.ivr_script
    GATEWAY_TWILIO_ACCOUNT_SID = var.twilio_account_sid
  }
  container_environment = merge(
    local.gateway_environment,
    var.sip_enabled ? local.sip_environment : {},
    { for name, value in local.optional_environment : name => value if value != null },
    var.extra_environment,
  )

  # With SIP, a shell entry point exports GATEWAY_SIP_PUBLIC_IP (IMDSv2 public-ipv4; the trunk
  # sends RTP and in-dialog requests there) and then execs the gateway (var.gateway_command as
  # "$@"). It fails the task at start when the host has no public IPv4. Without SIP the image's
  # own ENTRYPOINT and CMD run (gateway serve).
  sip_entrypoint_script = <<-EOT
    set -eu
    GATEWAY_SIP_PUBLIC_IP="$(python3 -c 'import urllib.request as r; m="http://169.254.169.254/latest/"; t=r.urlopen(r.Request(m+"api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}), timeout=5).read().decode(); print(r.urlopen(r.Request(m+"meta-data/public-ipv4", headers={"X-aws-ec2-metadata-token": t}), timeout=5).read().decode())')"
    export GATEWAY_SIP_PUBLIC_IP
    exec "$@"
  EOT

  gateway_container = {
    name      = "gateway"
    image     = "${aws_ecr_repository.gateway.repository_url}:${var.image_tag}"
    essential = true
    cpu       = var.container_cpu
    # Soft limit: model load peaks above steady state; the host runs nothing else.
    memoryReservation = var.container_memory_mib

    # One whole GPU per task: the scheduler places one task per single-GPU host.
    resourceRequirements = [{ type = "GPU", value = "1" }]

    # Host mode: containerPort == hostPort. The RTP range needs no mapping (the process binds
    # the host's ports itself; containerPortRange is not available in host mode).
    portMappings = concat(
      [{ containerPort = var.container_port, hostPort = var.container_port, protocol = "tcp" }],
      var.sip_enabled ? [{ containerPort = local.sip_port, hostPort = local.sip_port, protocol = "udp" }] : [],
    )

    environment = [for name, value in local.container_environment : { name = name, value = value }]
    secrets     = [for name, arn in local.container_secrets : { name = name, valueFrom = arn }]

    entryPoint = var.sip_enabled ? ["/bin/sh", "-c", local.sip_entrypoint_script, "gateway-entrypoint"] : null
    command    = var.sip_enabled ? var.gateway_command : null

    # SIGTERM starts the drain (no new calls, /readyz 503); the gateway hangs up what is left
    # after GATEWAY_DRAIN_GRACE_S and exits before this SIGKILL deadline.
    stopTimeout = local.stop_timeout_s
    # tini as PID 1 forwards SIGTERM to the gateway and reaps children.
    linuxParameters = { initProcessEnabled = true }

    # Liveness: /healthz answers as soon as the server runs (the engine loads in the
    # background). startPeriod is ECS's maximum, 300 s, in case model load and CUDA graph
    # capture starve the event loop; readiness (/readyz) is the load balancers' job.
    healthCheck = {
      command     = ["CMD", "python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:${var.container_port}/healthz', timeout=4)"]
      interval    = 15
      timeout     = 5
      retries     = 3
      startPeriod = 300
    }

    # One WebSocket (or RTP socket) per call, plus model files.
    ulimits = [{ name = "nofile", softLimit = 65536, hardLimit = 65536 }]

    logConfiguration = {
      logDriver = "awslogs"
      options = {
        "awslogs-group"         = aws_cloudwatch_log_group.gateway.name
        "awslogs-region"        = var.region
        "awslogs-stream-prefix" = "gateway"
      }
    }
  }
}

resource "aws_ecs_task_definition" "gateway" {
  family                   = var.name
  network_mode             = "host"
  requires_compatibilities = ["EC2"]
  execution_role_arn       = aws_iam_role.execution.arn
  task_role_arn            = aws_iam_role.task.arn

  # Containers are HCL objects (locals above and in autoscaling.tf) encoded here, so the test
  # suite can read the very values that are deployed.
  container_definitions = jsonencode([local.gateway_container, local.metrics_agent_container])
}

resource "aws_ecs_service" "gateway" {
  name            = local.service_name
  cluster         = aws_ecs_cluster.this.id
  task_definition = aws_ecs_task_definition.gateway.arn
  # Initial count; the scaling policy (autoscaling.tf) owns it afterwards.
  desired_count = var.min_replicas

  capacity_provider_strategy {
    capacity_provider = aws_ecs_capacity_provider.gpu.name
    weight            = 1
    base              = 0
  }

  deployment_minimum_healthy_percent = local.deployment_minimum_healthy_percent
  deployment_maximum_percent         = local.deployment_maximum_percent

  # A task that never gets ready (bad image, model that does not load) stops the rollout and
  # brings the last working task definition back.
  deployment_circuit_breaker {
    enable   = true
    rollback = true
  }

  # Load balancer health checks (/readyz) fail while the model downloads, loads and captures
  # its CUDA graphs; ECS ignores them this long instead of replacing the task mid-warm-up.
  health_check_grace_period_seconds = var.health_check_grace_s

  load_balancer {
    target_group_arn = aws_lb_target_group.http.arn
    container_name   = "gateway"
    container_port   = var.container_port
  }

  dynamic "load_balancer" {
    for_each = var.sip_enabled ? [aws_lb_target_group.sip[0].arn] : []
    content {
      target_group_arn = load_balancer.value
      container_name   = "gateway"
      container_port   = local.sip_port
    }
  }

  # Implied by host ports and the GPU, stated so placement errors say why.
  placement_constraints {
    type = "distinctInstance"
  }

  ordered_placement_strategy {
    type  = "spread"
    field = "attribute:ecs.availability-zone"
  }

  enable_ecs_managed_tags = true
  propagate_tags          = "SERVICE"

  depends_on = [
    aws_lb_listener.https,
    aws_lb_listener.sip,
    aws_ecs_cluster_capacity_providers.this,
    aws_iam_role_policy.execution_secrets,
  ]

  lifecycle {
    ignore_changes = [desired_count]

    precondition {
      condition = (
        ceil(var.min_replicas * local.deployment_minimum_healthy_percent / 100) < var.min_replicas
        || floor(var.min_replicas * local.deployment_maximum_percent / 100) > var.min_replicas
      )
      error_message = "Deployment percentages would deadlock: with one GPU per host ECS could neither stop an old task first nor start a new one."
    }
    precondition {
      condition     = var.min_replicas <= var.max_replicas
      error_message = "min_replicas must not exceed max_replicas."
    }
    precondition {
      condition     = var.target_calls_per_task < var.max_calls_per_task
      error_message = "target_calls_per_task must be below max_calls_per_task, or tasks refuse calls before autoscaling reacts."
    }
    precondition {
      condition     = var.drain_grace_s + 5 <= local.stop_timeout_s
      error_message = "drain_grace_s must leave 5 s inside the 120 s stopTimeout."
    }
    precondition {
      condition     = !var.sip_enabled || (length(var.sip_trunk_cidrs) > 0 && var.associate_public_ip)
      error_message = "sip_enabled needs sip_trunk_cidrs and associate_public_ip (RTP goes straight to the host's public IP)."
    }
    precondition {
      condition = (
        var.rtp_port_min <= var.rtp_port_max
        && (local.sip_port < var.rtp_port_min || local.sip_port > var.rtp_port_max)
        && (var.container_port < var.rtp_port_min || var.container_port > var.rtp_port_max)
      )
      error_message = "The RTP range must be ordered and must not contain the SIP or HTTP port."
    }
  }
}
