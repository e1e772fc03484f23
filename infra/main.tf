# Shared names and derived values. The resources live in the files named after them.

data "aws_partition" "current" {}

locals {
  cluster_name = var.name
  service_name = var.name

  # What Twilio requests and what the gateway validates X-Twilio-Signature against
  # (GATEWAY_PUBLIC_URL): scheme and host must match exactly.
  public_host = var.domain_name != null ? var.domain_name : aws_lb.alb.dns_name
  public_url  = "https://${local.public_host}"

  sip_port = 5060
  # The trunk often sends media from other addresses than its signalling.
  rtp_source_cidrs = length(var.rtp_source_cidrs) > 0 ? var.rtp_source_cidrs : var.sip_trunk_cidrs
}
