# ALB: 443/80 from alb_ingress_cidrs. GPU hosts: the gateway's HTTP port only from the ALB (and,
# with SIP, from the NLB for its /readyz health check); SIP and RTP over UDP only from the
# trunk's CIDRs. Host network mode, so these rules are the task's rules.

resource "aws_security_group" "alb" {
  name        = "${var.name}-alb"
  description = "ALB of ${var.name}: HTTPS (and the HTTP redirect) in, the gateway port out"
  vpc_id      = local.vpc_id
  tags        = { Name = "${var.name}-alb" }
}

resource "aws_vpc_security_group_ingress_rule" "alb_https" {
  for_each = toset(var.alb_ingress_cidrs)

  security_group_id = aws_security_group.alb.id
  description       = "HTTPS: Twilio webhooks and Media Streams"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_ingress_rule" "alb_http" {
  for_each = toset(var.alb_ingress_cidrs)

  security_group_id = aws_security_group.alb.id
  description       = "HTTP, redirected to HTTPS"
  ip_protocol       = "tcp"
  from_port         = 80
  to_port           = 80
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "alb_to_gateway" {
  security_group_id            = aws_security_group.alb.id
  description                  = "Forward to the gateway port and health-check /readyz"
  ip_protocol                  = "tcp"
  from_port                    = var.container_port
  to_port                      = var.container_port
  referenced_security_group_id = aws_security_group.gpu_hosts.id
}

resource "aws_security_group" "gpu_hosts" {
  name        = "${var.name}-gpu-hosts"
  description = "GPU hosts of ${var.name} (host network mode: the gateway task's ports)"
  vpc_id      = local.vpc_id
  tags        = { Name = "${var.name}-gpu-hosts" }
}

resource "aws_vpc_security_group_ingress_rule" "gateway_http_from_alb" {
  security_group_id            = aws_security_group.gpu_hosts.id
  description                  = "Gateway HTTP/WebSocket port, from the ALB only"
  ip_protocol                  = "tcp"
  from_port                    = var.container_port
  to_port                      = var.container_port
  referenced_security_group_id = aws_security_group.alb.id
}

resource "aws_vpc_security_group_egress_rule" "gpu_hosts_all" {
  security_group_id = aws_security_group.gpu_hosts.id
  description       = "ECR, Hugging Face, CloudWatch, Secrets Manager; RTP and SIP back to the trunk"
  ip_protocol       = "-1"
  cidr_ipv4         = "0.0.0.0/0"
}

# --- SIP (only with sip_enabled) ---------------------------------------------------------------

resource "aws_vpc_security_group_ingress_rule" "gateway_http_from_nlb" {
  count = var.sip_enabled ? 1 : 0

  security_group_id            = aws_security_group.gpu_hosts.id
  description                  = "NLB health check of the SIP target group (/readyz on the gateway port)"
  ip_protocol                  = "tcp"
  from_port                    = var.container_port
  to_port                      = var.container_port
  referenced_security_group_id = aws_security_group.nlb[0].id
}

# The NLB preserves the client address for UDP, so SIP arriving through it comes from the
# trunk's CIDRs; so do in-dialog requests (ACK, BYE) sent straight to the host's Contact address.
resource "aws_vpc_security_group_ingress_rule" "sip_from_trunk" {
  for_each = var.sip_enabled ? toset(var.sip_trunk_cidrs) : toset([])

  security_group_id = aws_security_group.gpu_hosts.id
  description       = "SIP over UDP from the trunk"
  ip_protocol       = "udp"
  from_port         = local.sip_port
  to_port           = local.sip_port
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_ingress_rule" "rtp_from_trunk" {
  for_each = var.sip_enabled ? toset(local.rtp_source_cidrs) : toset([])

  security_group_id = aws_security_group.gpu_hosts.id
  description       = "RTP over UDP from the trunk's media addresses"
  ip_protocol       = "udp"
  from_port         = var.rtp_port_min
  to_port           = var.rtp_port_max
  cidr_ipv4         = each.value
}
