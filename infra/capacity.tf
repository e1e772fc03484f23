# GPU capacity: a launch template on the ECS GPU-optimised AMI, an auto-scaling group, and an
# ECS capacity provider with managed scaling. ECS adds a host whenever a task cannot be placed
# (CapacityProviderReservation above target_capacity) - which is what lets a `surge` deployment
# start the new task before stopping the old one - and removes empty hosts afterwards.
# Managed termination protection keeps scale-in from terminating a host that still runs a task
# (and its calls); managed draining drains a host's tasks before EC2 replaces it.

data "aws_ssm_parameter" "ecs_gpu_ami" {
  name = var.ami_ssm_parameter
}

locals {
  # Peak task count: a deployment at max_replicas may run maximum_percent of it at once, one
  # task per host, so the group must be allowed to grow that far or a surge could not proceed.
  asg_max_size = floor(var.max_replicas * local.deployment_maximum_percent / 100)

  user_data = <<-EOT
    #!/bin/bash
    set -euo pipefail
    cat >>/etc/ecs/ecs.config <<'CONFIG'
    ECS_CLUSTER=${local.cluster_name}
    ECS_ENABLE_GPU_SUPPORT=true
    ECS_IMAGE_PULL_BEHAVIOR=${var.ecr_immutable_tags ? "prefer-cached" : "default"}
    CONFIG
  EOT
}

resource "aws_launch_template" "gpu" {
  name_prefix   = "${var.name}-gpu-"
  image_id      = data.aws_ssm_parameter.ecs_gpu_ami.insecure_value
  instance_type = var.instance_type
  user_data     = base64encode(local.user_data)

  iam_instance_profile {
    arn = aws_iam_instance_profile.instance.arn
  }

  network_interfaces {
    associate_public_ip_address = var.associate_public_ip
    security_groups             = [aws_security_group.gpu_hosts.id]
    delete_on_termination       = true
  }

  # IMDSv2 only, one hop: host-network containers (the gateway, to learn its public IP for SIP)
  # reach it, bridge-mode containers would not.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = var.root_volume_size_gb
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }

  monitoring {
    enabled = true
  }

  tag_specifications {
    resource_type = "instance"
    tags          = { Name = "${var.name}-gpu" }
  }
}

resource "aws_autoscaling_group" "gpu" {
  name_prefix         = "${var.name}-gpu-"
  vpc_zone_identifier = local.public_subnet_ids
  min_size            = 0
  max_size            = local.asg_max_size
  # Managed termination protection needs new instances protected; ECS lifts it from idle hosts.
  protect_from_scale_in = true
  health_check_type     = "EC2"

  launch_template {
    id      = aws_launch_template.gpu.id
    version = aws_launch_template.gpu.latest_version
  }

  tag {
    key                 = "AmazonECSManaged"
    value               = "true"
    propagate_at_launch = true
  }

  lifecycle {
    # The capacity provider owns the group's size.
    ignore_changes = [desired_capacity]
  }
}

resource "aws_ecs_capacity_provider" "gpu" {
  name = "${var.name}-gpu"

  auto_scaling_group_provider {
    auto_scaling_group_arn         = aws_autoscaling_group.gpu.arn
    managed_termination_protection = "ENABLED"
    managed_draining               = "ENABLED"

    managed_scaling {
      status = "ENABLED"
      # 100: no idle GPU host kept warm (expensive); a host is added when a task needs one.
      target_capacity           = 100
      minimum_scaling_step_size = 1
      maximum_scaling_step_size = local.asg_max_size
      # Boot, ECS agent registration and the image pull before a new host takes a task.
      instance_warmup_period = 300
    }
  }
}
