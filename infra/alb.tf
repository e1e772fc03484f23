# Twilio reaches the gateway here: POST /twilio/voice (webhook) and the Media Streams WebSocket
# (wss:// .../twilio/media). ALB listeners pass the WebSocket upgrade through without any extra
# configuration; the upgraded connection then stays on the task that accepted it. No stickiness
# is needed between the webhook, the stream and the <Connect action>: the TwiML carries the
# call's parameters (CallSid, From, To) into the stream, so any ready task can take the stream
# (against its own call budget: the webhook reserves nothing, GATEWAY_TWILIO_RESERVATION_S=0),
# and the task running the stream sends the call's transfer or hang-up to Twilio itself as a
# live-call update (var.twilio_account_sid), whichever task Twilio's next request reaches.

resource "aws_lb" "alb" {
  name               = "${var.name}-alb"
  load_balancer_type = "application"
  internal           = false
  security_groups    = [aws_security_group.alb.id]
  subnets            = local.public_subnet_ids

  # A Media Stream is one long-lived connection; the ALB closes a connection idle this long.
  # Twilio sends a media message every 20 ms while a call is up, so only a stalled stream
  # idles, but the timeout must never be what ends a legitimate call (max_call_duration_s).
  idle_timeout               = var.alb_idle_timeout_s
  drop_invalid_header_fields = true

  lifecycle {
    precondition {
      condition     = var.alb_idle_timeout_s >= var.max_call_duration_s
      error_message = "alb_idle_timeout_s must be at least max_call_duration_s."
    }
  }
}

resource "aws_lb_target_group" "http" {
  name        = "${var.name}-http"
  vpc_id      = local.vpc_id
  protocol    = "HTTP"
  port        = var.container_port
  target_type = "instance" # host network mode

  # The drain window: when a task leaves (deployment, scale-in), ECS deregisters it and waits
  # up to this long before SIGTERM; calls on it continue, new calls go elsewhere. The load
  # balancer closes connections still open when it runs out, and completes the deregistration
  # early when the task has none left (ELB docs, "Deregistration delay").
  deregistration_delay = var.drain_window_s

  # /readyz, not /healthz: a warming-up task (model load, graph capture) or a draining one
  # answers 503 and gets no new calls.
  health_check {
    path                = "/readyz"
    protocol            = "HTTP"
    matcher             = "200"
    interval            = 10
    timeout             = 5
    healthy_threshold   = 2
    unhealthy_threshold = 3
  }
}

resource "aws_lb_listener" "https" {
  load_balancer_arn = aws_lb.alb.arn
  port              = 443
  protocol          = "HTTPS"
  ssl_policy        = "ELBSecurityPolicy-TLS13-1-2-2021-06"
  certificate_arn   = var.certificate_arn

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.http.arn
  }
}

resource "aws_lb_listener" "http_redirect" {
  load_balancer_arn = aws_lb.alb.arn
  port              = 80
  protocol          = "HTTP"

  default_action {
    type = "redirect"
    redirect {
      protocol    = "HTTPS"
      port        = "443"
      status_code = "HTTP_301"
    }
  }
}

resource "aws_route53_record" "gateway" {
  count = var.domain_name != null && var.route53_zone_id != null ? 1 : 0

  zone_id = var.route53_zone_id
  name    = var.domain_name
  type    = "A"

  alias {
    name                   = aws_lb.alb.dns_name
    zone_id                = aws_lb.alb.zone_id
    evaluate_target_health = true
  }
}
