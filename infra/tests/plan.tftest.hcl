# Plan/apply the whole module against a mocked AWS provider: no account, no network.
#   cd infra && terraform init -backend=false && terraform test
# Needs Terraform >= 1.7 (mock_provider); the module itself needs >= 1.5. CI does not run this
# (no terraform binary there); tests/test_infra.py checks the invariants without it.

mock_provider "aws" {
  mock_data "aws_availability_zones" {
    defaults = { names = ["us-east-1a", "us-east-1b", "us-east-1c"] }
  }
  mock_data "aws_partition" {
    defaults = { partition = "aws" }
  }
  mock_data "aws_ssm_parameter" {
    defaults = { insecure_value = "ami-0123456789abcdef0" }
  }
  mock_data "aws_iam_policy_document" {
    defaults = { json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}" }
  }
  mock_resource "aws_secretsmanager_secret" {
    defaults = { arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:ivr-gateway/twilio-auth-token-abc" }
  }
  mock_resource "aws_autoscaling_group" {
    defaults = { arn = "arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:x:autoScalingGroupName/y" }
  }
  mock_resource "aws_iam_role" {
    defaults = { arn = "arn:aws:iam::123456789012:role/x" }
  }
  mock_resource "aws_iam_instance_profile" {
    defaults = { arn = "arn:aws:iam::123456789012:instance-profile/x" }
  }
  mock_resource "aws_ecs_task_definition" {
    defaults = { arn = "arn:aws:ecs:us-east-1:123456789012:task-definition/ivr-gateway:1" }
  }
  mock_resource "aws_lb_target_group" {
    defaults = { arn = "arn:aws:elasticloadbalancing:us-east-1:123456789012:targetgroup/x/1" }
  }
  mock_resource "aws_lb" {
    defaults = { arn = "arn:aws:elasticloadbalancing:us-east-1:123456789012:loadbalancer/app/x/1", dns_name = "x.elb.amazonaws.com" }
  }
  mock_resource "aws_launch_template" {
    defaults = { id = "lt-0123456789abcdef0", latest_version = 1 }
  }
  mock_resource "aws_ecs_capacity_provider" {
    defaults = { name = "ivr-gateway-gpu" }
  }
  mock_resource "aws_eip" {
    defaults = { id = "eipalloc-0123456789abcdef0", public_ip = "198.51.100.7" }
  }
  mock_resource "aws_security_group" {
    defaults = { id = "sg-0123456789abcdef0" }
  }
  mock_resource "aws_ecr_repository" {
    defaults = { repository_url = "123456789012.dkr.ecr.us-east-1.amazonaws.com/ivr-gateway" }
  }
}

variables {
  certificate_arn = "arn:aws:acm:us-east-1:123456789012:certificate/abc"
  domain_name     = "ivr.example.com"
}

run "defaults" {
  command = apply

  assert {
    condition     = output.twilio_voice_webhook_url == "https://ivr.example.com/twilio/voice"
    error_message = "The voice webhook must be https://<domain>/twilio/voice."
  }
  assert {
    condition     = output.deployment_percents.minimum_healthy_percent == 100 && output.deployment_percents.maximum_percent == 200
    error_message = "surge with one replica: min 100 / max 200."
  }
  assert {
    condition     = aws_autoscaling_group.gpu.max_size == 8
    error_message = "4 replicas surging 200% need 8 hosts."
  }
  assert {
    condition     = jsondecode(aws_ecs_task_definition.gateway.container_definitions)[0].resourceRequirements == [{ type = "GPU", value = "1" }]
    error_message = "The gateway reserves one GPU."
  }
  assert {
    condition     = [for s in jsondecode(aws_ecs_task_definition.gateway.container_definitions)[0].secrets : s.name] == ["GATEWAY_TWILIO_AUTH_TOKEN"]
    error_message = "Only the Twilio token is a secret without SIP."
  }
  assert {
    condition     = jsondecode(aws_ecs_task_definition.gateway.container_definitions)[0].entryPoint == null && jsondecode(aws_ecs_task_definition.gateway.container_definitions)[0].command == null
    error_message = "Without SIP the image's own ENTRYPOINT and CMD run."
  }
  assert {
    condition     = !contains([for e in jsondecode(aws_ecs_task_definition.gateway.container_definitions)[0].environment : e.name], "GATEWAY_MODEL")
    error_message = "The model baked into the image is used unless model_id is set."
  }
  assert {
    condition     = length(aws_lb.sip) == 0 && length(aws_eip.sip) == 0 && output.sip_uri == null
    error_message = "No NLB without SIP."
  }
}

run "sip_stop_first" {
  command = apply

  variables {
    sip_enabled          = true
    sip_trunk_cidrs      = ["203.0.113.0/24"]
    sip_users_secret_arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:sipusers-AbCdEf"
    deployment_strategy  = "stop_first"
    min_replicas         = 2
  }

  assert {
    condition     = length(aws_lb.sip) == 1 && aws_lb_listener.sip[0].protocol == "UDP" && aws_lb_target_group.sip[0].protocol == "UDP"
    error_message = "SIP goes through a UDP NLB listener."
  }
  assert {
    condition     = output.deployment_percents.minimum_healthy_percent == 50 && output.deployment_percents.maximum_percent == 100
    error_message = "stop_first with two replicas: min 50 / max 100."
  }
  assert {
    condition     = [for s in jsondecode(aws_ecs_task_definition.gateway.container_definitions)[0].secrets : s.name] == ["GATEWAY_SIP_USERS", "GATEWAY_TWILIO_AUTH_TOKEN"]
    error_message = "SIP digest users come from Secrets Manager too."
  }
  assert {
    condition     = jsondecode(aws_ecs_task_definition.gateway.container_definitions)[0].command == ["/opt/venv/bin/gateway", "serve"] && jsondecode(aws_ecs_task_definition.gateway.container_definitions)[0].entryPoint[0] == "/bin/sh"
    error_message = "With SIP a shell wrapper sets GATEWAY_SIP_PUBLIC_IP, then runs the gateway."
  }
  assert {
    condition     = output.sip_uri == "sip:198.51.100.7:5060;transport=udp"
    error_message = "The trunk URI points at the NLB's Elastic IP."
  }
}

run "min_above_max_rejected" {
  command = plan

  variables {
    min_replicas = 5
    max_replicas = 2
  }

  expect_failures = [aws_ecs_service.gateway]
}

run "sip_without_trunk_cidrs_rejected" {
  command = plan

  variables {
    sip_enabled = true
  }

  expect_failures = [aws_ecs_service.gateway]
}

run "short_idle_timeout_rejected" {
  command = plan

  variables {
    alb_idle_timeout_s = 900
  }

  expect_failures = [aws_lb.alb]
}
