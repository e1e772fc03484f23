output "twilio_voice_webhook_url" {
  description = "Paste into the Twilio number's Voice Configuration: 'A call comes in' -> Webhook, HTTP POST. The gateway answers with TwiML that opens the Media Stream (wss://<host>/twilio/media) and sets its own <Connect action> (/twilio/after-stream); it uses no separate status callback."
  value       = "${local.public_url}/twilio/voice"
}

output "public_url" {
  description = "GATEWAY_PUBLIC_URL: the https:// base Twilio requests and signatures are checked against."
  value       = local.public_url
}

output "alb_dns_name" {
  description = "The ALB's DNS name: point domain_name at it (CNAME or alias) if route53_zone_id is not set."
  value       = aws_lb.alb.dns_name
}

output "ecr_repository_url" {
  description = "Push the gateway image here as <url>:<image_tag>."
  value       = aws_ecr_repository.gateway.repository_url
}

output "twilio_auth_token_secret_arn" {
  description = "Secrets Manager secret the task reads GATEWAY_TWILIO_AUTH_TOKEN from; put the token into it (aws secretsmanager put-secret-value)."
  value       = local.twilio_auth_token_secret_arn
}

output "sip_nlb_dns_name" {
  description = "DNS name of the SIP NLB (null without sip_enabled)."
  value       = var.sip_enabled ? aws_lb.sip[0].dns_name : null
}

output "sip_nlb_addresses" {
  description = "Fixed public IPs of the SIP NLB, one per zone: the trunk's termination/origination target, UDP port 5060 (empty without sip_enabled)."
  value       = aws_eip.sip[*].public_ip
}

output "sip_uri" {
  description = "SIP URI for the trunk (null without sip_enabled). RTP and in-dialog requests then go to the answering host's own public IP."
  value       = var.sip_enabled ? "sip:${aws_eip.sip[0].public_ip}:${local.sip_port};transport=udp" : null
}

output "cluster_name" {
  description = "ECS cluster name."
  value       = aws_ecs_cluster.this.name
}

output "service_name" {
  description = "ECS service name."
  value       = aws_ecs_service.gateway.name
}

output "log_group_name" {
  description = "CloudWatch log group of the gateway's JSON logs."
  value       = aws_cloudwatch_log_group.gateway.name
}

output "deployment_percents" {
  description = "The service's deployment minimum healthy / maximum percent chosen by deployment_strategy."
  value = {
    minimum_healthy_percent = local.deployment_minimum_healthy_percent
    maximum_percent         = local.deployment_maximum_percent
  }
}
